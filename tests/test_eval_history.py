"""`normlab evaluate --checkpoint runs/NAME`: every checkpoint of a run, several held-out sets, skip what is done."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO, run_here
from tests.helpers.runs import scalars
from training.eval.cli import main
from training.eval.heldout import evaluate_sets

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


@pytest.fixture(scope="module")
def run(workdir) -> Path:
    """A 6-step run: checkpoints at steps 4 (the interval) and 6 (the end); the run validated at step 4."""
    run_here(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
              str(workdir / "runs"), "--name", "hist", "--trainer.max_steps", "6"])
    return workdir / "runs" / "hist"


def evaluate(caplog, *args: str) -> str:
    """`normlab evaluate ARGS` in this process; returns what it logged."""
    caplog.clear()
    with caplog.at_level("INFO", logger="training"):
        assert main(list(args)) == 0
    return caplog.text


def test_every_checkpoint_once_with_csv_json_and_tensorboard(run, caplog):
    first = evaluate(caplog, "--checkpoint", str(run))
    files = {step: run / "eval" / "val" / f"step-0000000{step}.json" for step in (4, 6)}
    results = {step: json.loads(path.read_text()) for step, path in files.items()}
    for step in (4, 6):  # the same numbers as the one-checkpoint evaluate
        single = evaluate_sets(run / "checkpoints" / f"step-0000000{step}", log_to_run=False)[0]
        assert {k: results[step][k] for k in ("loss", "perplexity", "bits_per_byte", "tokens")} == \
            {k: single[k] for k in ("loss", "perplexity", "bits_per_byte", "tokens")}
    # ... which are the run's own validation at step 4 (an independent computation, inside Lightning)
    assert results[4]["loss"] == pytest.approx(scalars(run, "val/loss")[4], rel=1e-6)
    assert results[4]["loss"] != results[6]["loss"]
    with open(run / "eval" / "val.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [4, 6]
    assert [float(r["loss"]) for r in rows] == [results[4]["loss"], results[6]["loss"]]
    assert scalars(run, "eval/val/loss") == pytest.approx({4: results[4]["loss"], 6: results[6]["loss"]})
    assert scalars(run, "eval/val/bpb") == pytest.approx({s: results[s]["bits_per_byte"] for s in (4, 6)})
    assert "step 6: val loss" in first

    mtimes = {step: path.stat().st_mtime_ns for step, path in files.items()}
    again = evaluate(caplog, "--checkpoint", str(run))
    assert again.count("already evaluated with these settings, skipped") == 2
    assert {step: path.stat().st_mtime_ns for step, path in files.items()} == mtimes
    scalars(run, "eval/val/loss")  # still one point per step (it asserts no duplicates)

    # Other settings are not "done": fewer tokens re-evaluates every step.
    evaluate(caplog, "--checkpoint", str(run), "--max_tokens", "64")
    assert json.loads(files[4].read_text())["tokens"] == 64


def test_several_named_sets(run, workdir, tmp_path, caplog, capsys):
    out = tmp_path / "sets.json"
    data = str(workdir / "tiny")
    evaluate(caplog, "--checkpoint", str(run / "checkpoints" / "step-00000006"), "--data", f"web={data}",
             f"books={data}", "--max_tokens", "160", "--output", str(out))
    sets = json.loads(out.read_text())["sets"]
    assert sorted(sets) == ["books", "web"] and sets["web"]["loss"] == sets["books"]["loss"]
    assert scalars(run, "eval/web/loss")[6] == pytest.approx(sets["web"]["loss"])

    capsys.readouterr()
    from training.cli import main as normlab  # (a user error is printed by the one entry point)

    assert normlab(["evaluate", "--checkpoint", str(run), "--data", f"a={data}", f"a={data}"]) == 2
    assert capsys.readouterr().err.startswith("normlab evaluate: error: --data: two sets are called 'a'")

"""`normlab evaluate --tasks`: lm-evaluation-harness on a normlab checkpoint, offline, against the harness's own
Hugging Face model (`hf`) on `normlab export`'s output — a local YAML multiple-choice task over a local JSONL."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.helpers.data import WORDS
from tests.helpers.multiproc import REPO, run_here
from tests.helpers.tasks import TASK, write_task

HELPERS = REPO / "tests" / "helpers"
MISSING = 'lm-evaluation-harness is the optional extra: pip install -e ".[eval]"'


def test_missing_extra_is_one_clear_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, "training.eval.tasks", raising=False)
    from training.cli import main as normlab  # (a user error is printed by the one entry point)

    assert normlab(["evaluate", "--checkpoint", str(tmp_path), "--tasks", "hellaswag"]) == 2
    assert capsys.readouterr().err == ('normlab evaluate: error: --tasks needs lm-evaluation-harness, which is not '
                                       'installed: pip install -e ".[eval]"\n')


@pytest.fixture(scope="module")
def exported(workdir) -> tuple[Path, Path]:
    """A 4-step checkpoint of a tiny run and its Hugging Face export."""
    pytest.importorskip("lm_eval", reason=MISSING)
    run_here(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
              str(workdir / "runs"), "--name", "harness", "--trainer.max_steps", "4"])
    ckpt = workdir / "runs" / "harness" / "checkpoints" / "step-00000004"
    from training.cli import main

    assert main(["export", "--checkpoint", str(ckpt), "--output", str(workdir / "hf")]) == 0  # (in this process)
    return ckpt, workdir / "hf"


@pytest.mark.slow
def test_multiple_choice_equals_the_harness_hf_model_on_the_export(exported, tmp_path, capsys):
    pytest.importorskip("lm_eval", reason=MISSING)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from training.eval.tasks import run_tasks

    ckpt, hf_dir = exported
    tasks = write_task(tmp_path)
    ours = run_tasks(ckpt, [TASK], batch_size=5, include_path=str(tasks))
    theirs = simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                             tasks=[TASK], batch_size=3, task_manager=TaskManager(include_path=str(tasks)),
                             log_samples=True, bootstrap_iters=0)
    assert ours["results"][TASK]["acc,none"] == theirs["results"][TASK]["acc,none"]
    ll = {doc["doc_id"]: [r[0] for r in doc["resps"]] for doc in ours["samples"][TASK]}
    ref = {doc["doc_id"]: [r[0] for r in doc["resps"]] for doc in theirs["samples"][TASK]}
    assert len(ll) == 12 and ll.keys() == ref.keys()
    for doc_id, expected in ref.items():
        assert len(ll[doc_id]) == 4
        for (ours_ll, ours_greedy), (ref_ll, ref_greedy) in zip(ll[doc_id], expected, strict=True):
            assert abs(ours_ll - ref_ll) <= 1e-4 and ours_greedy == ref_greedy, doc_id
    # The harness's results JSON sits beside the run's other results.
    written = json.loads((ckpt.parent.parent / "eval" / "lm_eval" / "step-00000004.json").read_text())
    assert written["results"]["results"][TASK]["acc,none"] == ours["results"][TASK]["acc,none"]
    assert written["metrics"][TASK]["acc"] == ours["metrics"][TASK]["acc"]


@pytest.mark.slow
def test_rolling_and_generation_equal_the_harness_hf_model(exported):
    pytest.importorskip("lm_eval", reason=MISSING)
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from training.checkpointing.load import load_checkpoint
    from training.eval.harness import NormlabLM

    ckpt, hf_dir = exported
    loaded = load_checkpoint(ckpt)
    ours = NormlabLM(loaded.model, loaded.tokenizer_path, batch_size=2)
    theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=2)
    text = " ".join(random.Random(1).choice(WORDS) for _ in range(40))  # longer than max_seq_len: several windows
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True)[0] == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True)[0], abs=1e-4)
    gen = [Instance("generate_until", {}, ("the cat sat on", {"until": ["."], "max_gen_toks": 8}), 0)]
    assert ours.generate_until(gen, disable_tqdm=True) == theirs.generate_until(gen, disable_tqdm=True)

"""`RunDir`, the one reader of a run directory: one TensorBoard reader, one definition of "finished" shared by
`normlab compare` and the sweep, and one error line for a damaged file whichever command reads it."""
from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import scalars
from training.cli import main as normlab
from training.run.dir import RunDir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def run(single_run: Path, tmp_path: Path) -> Path:
    """A copy of the 8-step reference run (checkpoints at steps 4 and 8, max_steps 8), to alter."""
    return Path(shutil.copytree(single_run, tmp_path / "runs" / "single"))


def test_there_is_one_tensorboard_reader():
    readers = sorted(str(p.relative_to(REPO)) for folder in ("training", "scripts", "data", "model")
                     for p in (REPO / folder).rglob("*.py") if "EventAccumulator" in p.read_text())
    assert readers == ["training/run/dir.py"]


def test_scalars_keep_the_newest_value_of_a_step_logged_twice(run):
    from torch.utils.tensorboard import SummaryWriter

    first = RunDir(run).scalars
    for tag in ("train/loss", "val/loss"):
        assert dict(first[tag]) == scalars(run, tag)  # TensorBoard's own reading, step by step
    with SummaryWriter(str(run)) as writer:  # a resumed run logging step 8 again, later
        writer.add_scalar("train/loss", 123.0, 8)
    again = RunDir(run)
    assert again.last("train/loss") == 123.0 and [s for s, _ in again.scalars["train/loss"]] == list(range(1, 9))
    assert RunDir(run).last("no/such/tag") is None


def _statuses(run: Path) -> tuple[str, str]:
    """(the status `normlab compare --group_by` gives the run, the sweep's)."""
    from training.compare import group
    from training.sweep.state import run_status

    return group([RunDir(run)], ["model.norm"], "val/loss")[0].status, run_status(run)[0]


def test_finished_means_one_thing_to_compare_and_the_sweep(run):
    assert _statuses(run) == ("finished", "finished")
    # A resume that asks for more steps rewrites the run's config.yaml at its start; until its next checkpoint
    # the newest one still says what it was trained towards.
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["max_steps"] = 16
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert _statuses(run) == ("finished", "finished")
    shutil.rmtree(run / "checkpoints" / "step-00000008")  # now short of its max_steps
    assert _statuses(run) == ("pending", "pending")
    record = run / "sweep-run.json"
    record.write_text(json.dumps({"status": "running", "pid": 2 ** 22 + 1, "host": socket.gethostname()}))
    assert _statuses(run) == ("pending", "pending")  # its process is gone: interrupted
    record.write_text(json.dumps({"status": "diverged"}))
    assert _statuses(run) == ("diverged", "diverged")
    record.write_text(json.dumps({"status": "finished"}))
    assert _statuses(run) == ("finished", "finished")


@pytest.mark.parametrize("damaged, command, fix", [
    ("config.yaml", ["compare", "{run}"], "rewritten by the next `normlab fit`"),
    ("checkpoints/step-00000008/config.yaml", ["compare", "{run}", "--group_by", "model.norm"],
     "the checkpoint was altered after it was saved"),
    ("sweep-run.json", ["compare", "{run}", "--group_by", "model.norm"], "delete it"),  # (read unless finished)
    ("checkpoints/step-00000004/model_config.json", ["evaluate", "--checkpoint", "{run}"],
     "the checkpoint was altered after it was saved"),
])
def test_a_damaged_file_is_one_line_naming_it_and_the_fix(run, tmp_path, capsys, damaged, command, fix):
    if damaged == "sweep-run.json":
        shutil.rmtree(run / "checkpoints" / "step-00000008")
    (run / damaged).write_text("{not: [valid")
    args = [a.format(run=run) for a in command]
    assert normlab([*args, *(["--plot", str(tmp_path / "p.png")] if args[0] == "compare" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"normlab {args[0]}: error: '{run / damaged}' cannot be read") and fix in err, err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "p.png").exists()


def test_the_names_of_a_runs_files_are_spelled_in_one_place():
    """Every file name of a run directory is run/layout.py's: no other module of training/ spells one (a reader or
    writer elsewhere takes the name from there, and RunDir is the one reader of the run-level files)."""
    import ast

    from training.run import layout

    names = {layout.CONFIG_FILE, layout.MODEL_CONFIG_FILE, layout.MANIFEST, layout.LOGGERS_FILE, layout.REQUEUES_FILE,
             layout.RUN_RECORD, layout.LOG_FILE, layout.LOCK_FILE, layout.SWEEP_STATE_FILE}
    spelled = [f"{p.relative_to(REPO)}:{n.lineno}: {n.value}" for p in sorted((REPO / "training").rglob("*.py"))
               if p != REPO / "training" / "run" / "layout.py" for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Constant) and n.value in names]
    assert spelled == []

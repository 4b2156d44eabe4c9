"""Sweep executors are a registry (training/sweep/executors.py): a new one is one class and one entry — the
command accepts it, runs through it, and the sweep's status asks it whether the attempts it recorded still run."""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from training.sweep import executors
from training.sweep.executors import EXECUTORS, Local, Slurm, executor_of

HELPERS = Path(__file__).resolve().parent / "helpers"


class Toy:
    """Records what it was asked to run, trains nothing; its attempts are alive while `running` says so."""

    name: ClassVar[str] = "toy"

    def __init__(self) -> None:
        self.launched: list[str] = []
        self.running = True

    def launch(self, spec, runs, max_parallel: int, wait: bool) -> int:
        self.launched = [r.rel for r in runs]
        return 0

    def alive(self, record: dict[str, Any]) -> bool:
        return self.running


def test_a_new_executor_is_one_class_and_one_entry(tmp_path, monkeypatch, capsys):
    from training.cli import main
    from training.run.layout import RUN_RECORD
    from training.sweep.state import run_status, write_json

    toy = Toy()
    monkeypatch.setitem(EXECUTORS, "toy", toy)
    shutil.copy(HELPERS / "tiny.yaml", tmp_path / "tiny.yaml")
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "runs_dir": str(tmp_path / "runs"),
                                    "base": {"config": [str(tmp_path / "tiny.yaml")]},
                                    "grid": {"optim.lr": [0.001, 0.002]}, "seeds": [0]}))
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", str(spec), "--executor", "toy"]) == 0
    assert toy.launched == ["lr=0.001/s0", "lr=0.002/s0"]
    # An attempt the toy recorded is alive exactly when the toy says so.
    run = tmp_path / "runs" / "s" / "lr=0.001" / "s0"
    write_json(run / RUN_RECORD, {"status": "running", "executor": "toy", "command": [], "attempts": 1})
    assert run_status(run)[0] == "running"
    toy.running = False
    assert run_status(run)[0] == "pending"
    monkeypatch.delitem(EXECUTORS, "toy")
    assert main(["sweep", str(spec), "--executor", "toy"]) == 2  # an unknown executor: one line, the choices
    assert "invalid choice: 'toy' (choose from 'local', 'slurm')" in capsys.readouterr().err


def test_each_executor_judges_its_own_attempts():
    """Local: this host's process (a dead or reused pid is not alive; another host's run cannot be seen: trusted).
    Slurm: on this host the process too; elsewhere whether squeue lists the job. A record from before executors
    were recorded is Slurm's when it names a Slurm job."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "command": []}
    dead = {**me, "pid": 2**22 + 12345}
    assert Local().alive(me) and not Local().alive(dead) and Local().alive({**dead, "host": "elsewhere"})
    assert Slurm().alive(me) and not Slurm().alive(dead)
    assert Slurm().alive({**dead, "host": "elsewhere", "slurm_job": None})  # no evidence of death
    assert isinstance(executor_of({"slurm_job": "17"}), Slurm) and isinstance(executor_of({}), Local)
    assert executors.EXECUTORS["slurm"].name == "slurm"


def test_executor_settings_live_under_the_executors_name_and_the_older_slurm_key_still_reads(tmp_path, capsys):
    """`executor: {slurm: {...}}` is the spec's home for an executor's settings; a top-level `slurm: {...}` (older
    specs) reads the same, both at once is refused, and a name that is no executor is one line naming the choices."""
    from training.cli import main
    from training.errors import UserError
    from training.sweep.slurm import script
    from training.sweep.spec import load_spec

    shutil.copy(HELPERS / "tiny.yaml", tmp_path / "tiny.yaml")
    base = {"name": "s", "runs_dir": str(tmp_path / "runs"), "base": {"config": [str(tmp_path / "tiny.yaml")]}}
    settings = {"partition": "gpu", "time": "01:00:00", "signal_seconds": 60}

    def spec(name: str, **keys: Any) -> Path:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**base, **keys}))
        return tmp_path / f"{name}.yaml"

    new, old = load_spec(spec("new", executor={"slurm": settings})), load_spec(spec("old", slurm=settings))
    assert new.slurm == old.slurm == settings
    assert script(new, tmp_path / "t.json", 2, None) == script(old, tmp_path / "t.json", 2, None)
    with pytest.raises(UserError, match=r"slurm settings are given twice, as `slurm:` and as `executor: \{slurm"):
        load_spec(spec("both", slurm=settings, executor={"slurm": settings}))
    assert main(["sweep", str(spec("bad", executor={"kubernetes": {}})), "--dry_run"]) == 2
    assert "executor key 'kubernetes' is not an executor; choose from local, slurm" in capsys.readouterr().err

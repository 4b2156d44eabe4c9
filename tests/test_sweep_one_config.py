"""One sweep trains one config: a `-c` file or the spec edited while a local sweep runs stops it from starting any
further run (training/sweep/runner.py `Snapshot`), and `--report` refuses a cell whose runs were recorded with
different configs (training/sweep/results.py `check_one_config_per_cell`)."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler at import)
import pytest
import yaml

from tests.helpers.multiproc import REPO
from training.cli import main
from training.cli_checks import CONFIG_HASHES_ENV
from training.errors import DEBUG_ENV, UserError
from training.run.dir import RunDir
from training.run.layout import RUN_RECORD
from training.sweep.launch import config_hashes
from training.sweep.results import check_one_config_per_cell
from training.sweep.runner import Snapshot
from training.sweep.spec import load_spec
from training.sweep.state import write_json

TINY = REPO / "tests" / "helpers" / "tiny.yaml"


def write_spec(work: Path, seeds: list[int], lr: float = 0.001) -> tuple[Path, Path]:
    """A one-cell spec over tiny.yaml and a `-c` file of its own (holding the LR)."""
    (work / "base_cfg.yaml").write_text(f"optim:\n  lr: {lr}\n")
    spec = {"name": "edited", "runs_dir": str(work / "runs"),
            "base": {"config": [str(TINY), str(work / "base_cfg.yaml")],
                     "overrides": {"data.path": str(work / "tiny"), "trainer.max_steps": 2,
                                   "checkpoint.every_n_steps": 2, "metrics.every_n_steps": 0}},
            "seeds": seeds, "metric": "train/loss"}
    (work / "edited.yaml").write_text(yaml.safe_dump(spec))
    return work / "edited.yaml", work / "base_cfg.yaml"


def test_an_edit_after_the_sweep_started_is_refused_before_the_next_run(tmp_path):
    """Each check sees the files as they are now against the snapshot taken when the sweep started."""
    spec_path, cfg = write_spec(tmp_path, [0, 1])
    spec = load_spec(spec_path)
    run = spec.runs()[1]
    snapshot = Snapshot.take(spec, spec.runs())
    snapshot.check(run)  # nothing changed
    cfg.write_text("optim:\n  lr: 0.02\n")
    with pytest.raises(UserError, match=rf"^{cfg} was edited since this sweep started: base/s1 and the runs after it "
                                        r"were not started, so that the sweep trains one config"):
        snapshot.check(run)
    cfg.write_text("optim:\n  lr: 0.001\n")
    snapshot.check(run)  # restored: the same config again
    spec_path.write_text(spec_path.read_text().replace("max_steps: 2", "max_steps: 3"))
    with pytest.raises(UserError, match=rf"^the spec '{spec_path}' was edited \(the command of base/s1 changed\) "
                                        "since this sweep started"):
        snapshot.check(run)
    spec_path.write_text(spec_path.read_text().replace("max_steps: 3", "max_steps: 2") + "# a comment\n")
    snapshot.check(run)  # an edit that changes no command
    cfg.unlink()
    with pytest.raises(UserError, match=rf"^{cfg} was deleted since this sweep started"):
        snapshot.check(run)


def test_a_fit_refuses_a_config_file_edited_after_its_sweep_recorded_it(workdir, tmp_path, capsys, monkeypatch):
    """The sweep hands each fit the hashes it records (CONFIG_HASHES_ENV): a file edited between the record and the
    fit's read — the moment a run starts — is refused by the fit itself, in one line, before anything is written."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    _, cfg = write_spec(tmp_path, [0])
    monkeypatch.setenv(CONFIG_HASHES_ENV, json.dumps({str(cfg): hashlib.sha256(b"optim:\n  lr: 0.02\n").hexdigest()}))
    argv = ["fit", "-c", str(TINY), "-c", str(cfg), "--data.path", str(workdir / "tiny"), "--runs_dir",
            str(tmp_path / "runs"), "--trainer.max_steps", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"normlab fit: error: -c {cfg} was edited after `normlab sweep` recorded this run's config: a sweep trains "
        "one config; restore the file, or give the edited spec a new name")
    assert not (tmp_path / "runs").exists()
    cfg.write_text("optim:\n  lr: 0.02\n")  # the content recorded: the same fit starts
    assert main([*argv, "--checkpoint.every_n_steps", "0", "--trainer.logger", "false"]) == 0


def test_a_config_file_named_inside_a_c_file_is_part_of_its_hash(workdir, tmp_path, capsys, monkeypatch):
    """`optim: opt.yaml` in a -c file is read by the parser as opt.yaml's contents: an edit of opt.yaml changes what
    a run trains as an edit of the -c file does, so the sweep's hashes, its snapshot and a fit's check all see it."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    spec_path, cfg = write_spec(tmp_path, [0, 1])
    (tmp_path / "conf").mkdir()
    opt = tmp_path / "conf" / "opt.yaml"  # named relative to the directory of the file naming it
    opt.write_text("lr: 0.001\n")
    cfg.write_text("optim: conf/opt.yaml\n")
    spec = load_spec(spec_path)
    hashes, snapshot = config_hashes(spec), Snapshot.take(spec, spec.runs())
    assert hashes[str(cfg)] != hashlib.sha256(cfg.read_bytes()).hexdigest()  # the nested file is in it
    opt.write_text("lr: 0.02\n")
    assert config_hashes(spec) != hashes
    with pytest.raises(UserError, match=rf"^{cfg} \(or a config file it names: {opt}\) was edited since this sweep "
                                        "started"):
        snapshot.check(spec.runs()[1])
    monkeypatch.setenv(CONFIG_HASHES_ENV, json.dumps(hashes))
    assert main(["fit", "-c", str(TINY), "-c", str(cfg), "--data.path", str(workdir / "tiny"), "--runs_dir",
                 str(tmp_path / "runs"), "--trainer.max_steps", "1"]) == 2
    assert capsys.readouterr().err == (
        f"normlab fit: error: -c {cfg} (or a config file it names: {opt}) was edited after `normlab sweep` recorded "
        "this run's config: a sweep trains one config; restore the file, or give the edited spec a new name\n")
    assert not (tmp_path / "runs").exists()
    opt.write_text("lr: 0.001\n")
    assert config_hashes(spec) == hashes
    snapshot.check(spec.runs()[1])  # restored: the same config again


def record(work: Path, rel: str, lr_file_text: str, lr: str = "0.001") -> None:
    """The record `normlab sweep` keeps of a finished run: its command and the sha256 of its -c file."""
    write_json(work / rel / RUN_RECORD, {
        "command": ["python", "-m", "training.cli", "fit", "-c", "base_cfg.yaml", f"--optim.lr={lr}",
                    f"--seed_everything={rel[-1]}", f"--runs_dir={work / rel.split('/')[0]}", f"--name={rel[-2:]}",
                    "--ckpt_path=last"],
        "config_hashes": {"base_cfg.yaml": hashlib.sha256(lr_file_text.encode()).hexdigest()}, "status": "finished"})


def test_a_cell_recorded_with_two_configs_is_refused(tmp_path):
    runs = [{"cell": "base", "run_dir": f"base/s{seed}", "status": "finished"} for seed in (0, 1, 2)]
    for seed in (0, 1, 2):
        record(tmp_path, f"base/s{seed}", "optim: {lr: 0.001}\n")
    check_one_config_per_cell(tmp_path, runs)  # seeds differ only in what seeds differ in
    record(tmp_path, "base/s2", "optim: {lr: 0.02}\n")
    with pytest.raises(UserError, match=r"^cell 'base' holds runs trained with different configs \(base/s0, base/s1 "
                                        r"vs base/s2: base_cfg.yaml edited between them\); the report would judge "
                                        "them as one"):
        check_one_config_per_cell(tmp_path, runs)
    record(tmp_path, "base/s2", "optim: {lr: 0.001}\n", lr="0.003")
    with pytest.raises(UserError, match=r"\(base/s0, base/s1 vs base/s2: --optim.lr=0.001 / --optim.lr=0.003\)"):
        check_one_config_per_cell(tmp_path, runs)
    check_one_config_per_cell(tmp_path, [{**r, "status": "pending"} if r["run_dir"] == "base/s2" else r
                                         for r in runs])  # a run the report leaves out is not judged


def when_training(run_dir: Path, then, timeout: float = 300) -> threading.Thread:
    """Call `then()` once the run's fit has read its config and writes its run directory (from a thread: the sweep
    holds the main one)."""
    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (run_dir / "config.yaml").is_file():
            time.sleep(0.05)
        then()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_local_sweep_edited_while_it_runs_trains_one_config(workdir, tmp_path, capsys, monkeypatch):
    """The -c file is edited (lr 0.001 → 0.02) while the first of two runs trains: that run keeps its config, the
    second is not started and the sweep ends with one line (exit 2). Restored, the sweep trains the second run
    at the first's config and reports. A cell recorded with two configs (as an edit between two runs left it before
    this check, or a run trained by hand) makes `--report` refuse in one line."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    (tmp_path / "tiny").symlink_to(workdir / "tiny")
    spec, cfg = write_spec(tmp_path, [0, 1])
    sweep_dir = tmp_path / "runs" / "edited"
    watcher = when_training(sweep_dir / "base" / "s0", lambda: cfg.write_text("optim:\n  lr: 0.02\n"))
    assert main(["sweep", str(spec)]) == 2
    watcher.join()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"normlab sweep: error: {cfg} was edited since this sweep started: base/s1 and the runs "
                           "after it were not started"), last
    trained = yaml.safe_load((sweep_dir / "base" / "s0" / "config.yaml").read_text())
    assert trained["optim"]["lr"] == 0.001  # the run started before the edit kept its config
    assert not (sweep_dir / "base" / "s1" / RUN_RECORD).exists()  # never started

    cfg.write_text("optim:\n  lr: 0.001\n")
    assert main(["sweep", str(spec)]) == 0
    assert yaml.safe_load((sweep_dir / "base" / "s1" / "config.yaml").read_text())["optim"]["lr"] == 0.001
    assert main(["sweep", str(spec), "--report"]) == 0
    capsys.readouterr()

    edited = RunDir(sweep_dir / "base" / "s1").record
    edited["config_hashes"] = {str(cfg): hashlib.sha256(b"optim:\n  lr: 0.02\n").hexdigest()}
    (sweep_dir / "base" / "s1" / RUN_RECORD).write_text(json.dumps(edited))
    report = (sweep_dir / "report" / "report.md").read_bytes()
    assert main(["sweep", str(spec), "--report"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"normlab sweep: error: cell 'base' holds runs trained with different configs (base/s0 vs base/s1: {cfg} "
        "edited between them); the report would judge them as one. Retrain the runs of one config (delete their "
        "directories, then run the sweep again with the spec and files they should have)")
    assert (sweep_dir / "report" / "report.md").read_bytes() == report  # the earlier report is left as it was

"""Training one run: its `fit` subprocess, its record, and the outcome of the attempt.

The same code trains a run under the local executor (one thread per run) and inside a Slurm task, so both
record a run the same way (state.py). The command is always the run's own `fit ... --ckpt_path=last`: it starts
the run, or resumes it from its newest complete checkpoint — the sweep adds no resume logic of its own.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.cli_checks import CONFIG_HASHES_ENV, config_digest, edited_name
from training.errors import UserError
from training.run.dir import RunDir
from training.run.layout import LOG_FILE, RUN_RECORD
from training.sweep.spec import Run, Spec, load_spec
from training.sweep.state import run_status, write_json

# What a run's log says when normlab's guard stopped it on a non-finite loss or gradient (callbacks/guard.py).
DIVERGED_MARK = "NonFiniteError"



def config_hashes(spec: Spec) -> dict[str, str]:
    """The digest of each `-c` file and the config files it names (`config_digest`): an edit of a base config
    changes a run's config as much as an edited argument."""
    return {c: config_digest(c) for c in spec.configs}


def identity(args: list[str]) -> list[str]:
    """The arguments that decide what a run trains — all but where it lives (the sweep directory may move)."""
    return [a for a in args if not a.startswith("--runs_dir=")]


def check_unchanged(spec: Spec, runs: list[Run]) -> None:
    """Refuse (one line naming the run) a spec whose edit would change the config of a run already trained."""
    hashes = config_hashes(spec)
    for run in runs:
        run_dir = spec.sweep_dir / run.rel
        record = RunDir(run_dir).record
        if record is None or (RunDir(run_dir).progress()[0] == 0 and run_status(run_dir)[0] != "finished"):
            continue  # nothing trained yet: the new spec simply applies
        old, new = identity(record.get("command", [])[4:]), identity(run.fit_args)
        changed = [a for a in new if a not in old] + [f"(dropped {a})" for a in old if a not in new]
        changed += [f"{edited_name(c)} (file edited)" for c, h in hashes.items()
                    if record.get("config_hashes", {}).get(c, h) != h]
        if changed:
            raise UserError(f"run '{run_dir}' was trained with a different config ({', '.join(changed)}); restore "
                            "the spec, or give the edited spec a new name (or delete that run to retrain it)")


def _file_hash(path: str) -> str | None:
    try:
        return config_digest(path)
    except OSError:
        return None  # deleted or unreadable: it differs from any hash taken before


@dataclass(frozen=True)
class Snapshot:
    """What a sweep trains, taken when it starts: the digest of each `-c` file (with the config files it names,
    `config_digest`) and every run's command. A fit reads its `-c` files when it starts, so an edit while the
    sweep runs would train the runs started after it with another config than those before: `check` refuses to
    start them, and each run's fit is told the hashes (`train`), so one that starts in the moment of an edit
    refuses the file it reads."""

    spec: Spec
    hashes: dict[str, str | None]
    commands: dict[str, list[str]]

    @classmethod
    def take(cls, spec: Spec, runs: list[Run]) -> Snapshot:
        return cls(spec, {c: _file_hash(c) for c in spec.configs}, {r.rel: identity(r.fit_args) for r in runs})

    def check(self, run: Run) -> None:
        """Before `run` starts: a UserError if a `-c` file or the spec on disk changed what the sweep trains."""
        now = {c: _file_hash(c) for c in self.hashes}
        changed = [f"{c} was deleted" if now[c] is None else f"{edited_name(c)} was edited"
                   for c, h in self.hashes.items() if now[c] != h]
        if not changed:
            try:
                command = {r.rel: identity(r.fit_args) for r in load_spec(self.spec.path).runs()}.get(run.rel)
            except UserError as err:
                changed = [f"the spec no longer loads ({err})"]
            else:
                if command != self.commands.get(run.rel):
                    changed = [f"the spec '{self.spec.path}' was edited (the command of {run.rel} changed)"]
        if changed:
            raise UserError(f"{'; '.join(changed)} since this sweep started: {run.rel} and the runs after it were not "
                            "started, so that the sweep trains one config (the runs started before keep theirs). "
                            "Restore it and run the sweep again, or give the edited spec a new name")


def attempt_outcome(returncode: int, run_dir: Path, log_from: int) -> tuple[str, str | None]:
    """(status, the error line) of an attempt that exited with `returncode`: its log since `log_from` tells a
    divergence (normlab's guard) from any other failure."""
    if returncode == -signal.SIGTERM:
        return "pending", None  # stopped before its SIGTERM handler was in place (still starting): interrupted
    if returncode == 0:  # finished, unless its newest checkpoint is short of max_steps: stopped by a signal
        return ("pending" if RunDir(run_dir).reached_max_steps() is False else "finished"), None
    try:
        with open(run_dir / LOG_FILE, "rb") as f:
            f.seek(log_from)
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    error = next((ln for ln in reversed(lines) if "Error" in ln or "error:" in ln), lines[-1] if lines else None)
    diverged = any(DIVERGED_MARK in ln for ln in lines)
    return ("diverged" if diverged else "failed"), error or f"exit status {returncode}"


def train(spec: Spec, run: Run, env: dict[str, str] | None = None,
          started: Callable[[subprocess.Popen], Any] | None = None, prefix: list[str] | None = None,
          extra: list[str] | None = None, hashes: dict[str, str] | None = None, executor: str = "local") -> str:
    """Train `run` to its end or to its first stop, recording it; returns its status. `started` is called with
    the fit process (the executors keep it to forward signals); `prefix` runs the command through a launcher
    (Slurm's `srun`); `extra` are fit arguments of the executor's that do not change what the run computes
    (its `cluster.*` settings), added after the run's own and not part of its recorded command. `hashes`: the
    `-c` files' sha256 the run must train with (default: as they are now); they are recorded, and the fit refuses
    a file that no longer has its hash (CONFIG_HASHES_ENV). `executor`: the name the attempt is recorded with, so
    that its liveness is asked of that executor (executors.py)."""
    run_dir = spec.sweep_dir / run.rel
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_FILE
    log_from = log_path.stat().st_size if log_path.exists() else 0
    previous = RunDir(run_dir).record or {}
    hashes = config_hashes(spec) if hashes is None else hashes
    base = {"command": run.command, "config_hashes": hashes, "attempts": previous.get("attempts", 0) + 1}
    with open(log_path, "ab") as log:
        log.write(f"=== sweep attempt {base['attempts']} on {socket.gethostname()} at "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} ===\n".encode())
        log.flush()
        proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "training.cli", "fit", *run.fit_args,
                                 *(extra or [])],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {}), CONFIG_HASHES_ENV: json.dumps(hashes)})
    base["started"] = time.time()
    write_json(run_dir / RUN_RECORD, {**base, "status": "running", "executor": executor, "pid": proc.pid,
                                      "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID")})
    if started is not None:
        started(proc)
    returncode = proc.wait()
    status, error = attempt_outcome(returncode, run_dir, log_from)
    write_json(run_dir / RUN_RECORD, {**base, "status": status, "exit_code": returncode, "error": error,
                                      "ended": time.time()})
    return status

"""The Slurm executor: the runs not finished as one job array (one task per run), from a generated sbatch script.

A generated script rather than submitit: the job is a file a user can read, edit and `sbatch` again; it needs
neither pickled Python nor Slurm accounting (submitit's job states come from `sacct`, which many small clusters
do not run); and the pre-emption path is explicit. Each task runs `python -m training.sweep.slurm TASKS INDEX`,
which trains its run exactly as the local executor does (launch.train: `fit ... --ckpt_path=last`).

Time limits and pre-emption: `--signal=B:USR1@<signal_seconds>` makes Slurm send USR1 to the task that long
before the limit. The task forwards SIGTERM to its fit, which finishes its optimizer step, saves it and exits
(training/callbacks/stop_signals.py); then the task requeues itself (`scontrol requeue $SLURM_JOB_ID`), and the
requeued task resumes from that checkpoint — until the run reaches max_steps. A SIGTERM to the task (pre-emption
with a grace time, scancel) is forwarded the same way; whether the job comes back is then Slurm's decision.
Logs go to `<sweep>/slurm/%A_%a.out` with `--open-mode=append`, so a restart does not truncate them.

Spec `slurm:` keys (all optional): nodes, gpus_per_node, cpus_per_task, mem, time, partition, account,
max_parallel (the array's `%` limit), signal_seconds (default 120), extra (more sbatch options, e.g.
`--qos=high`), setup (shell lines run before the task, e.g. `source venv/bin/activate`). With more than one
process per job (nodes × gpus_per_node > 1) the fit is started through `srun`, one task per GPU, as Lightning's
SLURM environment expects: set trainer.num_nodes and trainer.devices in the spec to match.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.rundir import RunDir
from training.sweep.launch import train
from training.sweep.runner import claimed, status_table
from training.sweep.spec import Run, Spec, load_spec
from training.sweep.state import write_json, write_state

log = logging.getLogger("training.sweep.slurm")  # also when run as __main__ (the array task)

SLURM_KEYS = ("nodes", "gpus_per_node", "cpus_per_task", "mem", "time", "partition", "account", "max_parallel",
              "signal_seconds", "extra", "setup")


def resources(spec: Spec) -> dict[str, Any]:
    res = dict(spec.slurm)
    unknown = sorted(set(res) - set(SLURM_KEYS))
    if unknown:
        raise UserError(f"sweep spec '{spec.path}': unknown slurm key {unknown[0]!r}; valid: {', '.join(SLURM_KEYS)}")
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "max_parallel", "signal_seconds"):
        if key in res and (not isinstance(res[key], int) or isinstance(res[key], bool) or res[key] < 0):
            raise UserError(f"sweep spec '{spec.path}': slurm.{key} {res[key]!r} must be a non-negative integer")
    for key in ("extra", "setup"):
        if not isinstance(res.get(key, []), list):
            raise UserError(f"sweep spec '{spec.path}': slurm.{key} must be a list of strings, got {res[key]!r}")
    return res


def script(spec: Spec, tasks_file: Path, n: int, max_parallel: int | None) -> str:
    """The sbatch script of an array of `n` tasks."""
    res = resources(spec)
    nodes, gpus = res.get("nodes", 1) or 1, res.get("gpus_per_node", 0)
    limit = max_parallel or res.get("max_parallel")
    opts = [f"--job-name=sweep-{spec.name}", f"--array=0-{n - 1}" + (f"%{limit}" if limit else ""),
            f"--nodes={nodes}", f"--ntasks-per-node={max(gpus, 1)}",
            f"--output={spec.sweep_dir / 'slurm' / '%A_%a.out'}", "--open-mode=append", "--requeue",
            f"--signal=B:USR1@{res.get('signal_seconds', 120)}", f"--chdir={Path.cwd()}"]
    opts += [f"--gpus-per-node={gpus}"] if gpus else []
    opts += [f"--{key.replace('_', '-')}={res[key]}" for key in ("cpus_per_task", "mem", "time", "partition",
                                                                 "account") if res.get(key) is not None]
    opts += [str(e) for e in res.get("extra", [])]
    task = [sys.executable, "-m", "training.sweep.slurm", str(tasks_file), "$SLURM_ARRAY_TASK_ID"]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             "# Each task trains one run of the sweep (training/sweep/slurm.py); USR1 before the time limit",
             "# makes it save, requeue itself and resume.", *map(str, res.get("setup", [])),
             "exec " + " ".join(shlex.quote(a) if not a.startswith("$") else f'"{a}"' for a in task)]
    return "\n".join(lines) + "\n"


def submit(spec: Spec, runs: list[Run], max_parallel: int | None, wait: bool = False) -> int:
    """Submit the runs not finished (nor running) as one array; with `wait`, follow it to its end."""
    resources(spec)  # a bad slurm: key is reported before anything is written
    with claimed(spec, runs) as todo:
        if not todo:
            sys.stdout.write(f"sweep {spec.name}: nothing to train\n")
            return 0
        stamp = time.strftime("%Y%m%d-%H%M%S")
        slurm_dir = spec.sweep_dir / "slurm"
        tasks_file = slurm_dir / f"tasks-{stamp}.json"
        write_json(tasks_file, {"spec_path": str(spec.path.absolute()), "runs": [r.rel for r in todo]})
        script_file = slurm_dir / f"array-{stamp}.sbatch"
        script_file.write_text(script(spec, tasks_file, len(todo), max_parallel))
        try:
            out = subprocess.run(["sbatch", "--parsable", str(script_file)], capture_output=True, text=True)
        except FileNotFoundError as err:
            raise UserError("sbatch is not on the PATH: run --executor slurm on a Slurm login node") from err
        if out.returncode != 0:
            raise UserError(f"sbatch {script_file} failed: {' '.join(out.stderr.split())}")
        job = out.stdout.strip().split(";")[0]
        write_json(slurm_dir / f"job-{job}.json", {"job_id": job, "script": str(script_file),
                                                   "runs": [r.rel for r in todo]})
        sys.stdout.write(f"sweep {spec.name}: submitted job array {job} ({len(todo)} runs; script {script_file})\n")
    if wait:
        wait_for(job)
        sys.stdout.write(status_table(spec, runs))
    return 0


def wait_for(job: str, poll: float = 5.0) -> None:
    """Until no task of the array is pending, running or requeued (squeue lists none)."""
    while True:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True)
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(poll)


class _Task:
    """The signal handling of one array task around its fit process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.requeue = False

    def handle(self, signum: int, _frame: Any) -> None:
        self.requeue = self.requeue or signum == signal.SIGUSR1  # the time-limit / pre-emption warning
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def started(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.requeue:  # the warning came while the fit was starting
            proc.send_signal(signal.SIGTERM)


def task_main(argv: list[str]) -> int:
    """`python -m training.sweep.slurm TASKS_JSON INDEX`: train one run; requeue the job if warned in time."""
    tasks = json.loads(Path(argv[0]).read_text())
    spec = load_spec(tasks["spec_path"])
    runs = spec.runs()
    rel = tasks["runs"][int(argv[1])]
    run = next((r for r in runs if r.rel == rel), None)
    if run is None:
        raise UserError(f"run {rel} is no longer in the spec '{spec.path}' (edited since the array was submitted); "
                        "restore the spec or cancel the array")
    task = _Task()
    for s in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(s, task.handle)
    res = resources(spec)
    procs = (res.get("nodes", 1) or 1) * max(res.get("gpus_per_node", 0), 1)
    prefix = ["srun", "--kill-on-bad-exit=1", "--export=ALL"] if procs > 1 else None
    on_change = lambda *_: write_state(spec, runs)  # noqa: E731
    status = train(spec, run, started=lambda p: (task.started(p), on_change()), prefix=prefix)
    write_state(spec, runs)
    log.info("%s: %s (restart %s)", run.rel, status, os.environ.get("SLURM_RESTART_COUNT", "0"))
    if task.requeue and status == "pending":
        job = os.environ["SLURM_JOB_ID"]
        # Logged first: a successful requeue ends this process at once (Slurm cancels the running job).
        log.info("%s saved step %d on the warning; requeueing job %s", run.rel,
                 RunDir(spec.sweep_dir / run.rel).progress()[0], job)
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if out.returncode == 0:
            return 0
        log.error("scontrol requeue %s failed: %s", job, out.stderr.strip())
        return 1
    return 0 if status in ("finished", "diverged") else 1


if __name__ == "__main__":
    from training.cli import _setup_logging
    from training.errors import is_user_error, report

    _setup_logging()
    try:
        sys.exit(task_main(sys.argv[1:]))
    except Exception as err:
        if not is_user_error(err):
            raise
        sys.exit(report("sweep", err))

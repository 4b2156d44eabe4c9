"""The Slurm executor: the runs not finished as one job array (one task per run), from a generated sbatch script.

A generated script rather than submitit: the job is a file a user can read, edit and `sbatch` again; it needs
neither pickled Python nor Slurm accounting (submitit's job states come from `sacct`, which many small clusters
do not run); and the pre-emption path is explicit. Each task runs `python -m training.sweep.slurm TASKS INDEX`,
which trains its run exactly as the local executor does (launch.train: `fit ... --ckpt_path=last`) — through
`srun`, one process per GPU, when a run has more than one process (nodes × gpus_per_node > 1).

The task trains what was submitted: the tasks file records each run's command and the sha256 of every `-c` file
at submission, and a task whose spec or config files changed since is refused in one line (it would otherwise
resume the run with another config and record the new one as if nothing had happened).

Time limits (measured with Slurm 22.05): `--signal=B:USR1@<signal_seconds>` makes Slurm send USR1 to the task —
only the batch step — that long before the limit. The task passes the warning on to its fit: to the process
itself, or to `srun`, which forwards SIGUSR1/SIGUSR2 to every task of the step (SIGTERM or SIGHUP to srun would
terminate the step at once: "forcing job termination", tasks killed). The fit's ranks finish their step, save it,
and the fit's rank 0 requeues the job (`scontrol requeue`, training/cluster/requeue.py); the requeued task resumes from
that checkpoint. SIGTERM to the task (scancel) is passed on the same way, but the fit then only saves and exits:
whether the job comes back is Slurm's decision. A fit whose rank was lost (a node's processes killed, a hung rank
timed out: see training/cluster/failure.py) makes the task requeue the job, unless the run has been requeued
`max_requeues` times in a row without progress. Logs go to `<sweep>/slurm/%A_%a.out` with `--open-mode=append`,
so a restart does not truncate them; each fit's own log is its run directory's fit.log.

Spec `executor: {slurm: {...}}` keys (or a top-level `slurm:`; all optional): nodes, gpus_per_node,
cpus_per_task, mem, time, partition, account, max_parallel (the array's `%` limit), signal_seconds (default 120:
at least one step and one save), signal (USR1 or USR2), max_requeues (default 3), extra (more sbatch options,
e.g. `--qos=high`), setup (shell lines run before the task, e.g. `source venv/bin/activate`). Set
trainer.num_nodes and trainer.devices in the spec to match nodes and gpus_per_node.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from data.atomic import write_text_atomic
from training.cli_checks import edited_name
from training.cluster.failure import LOST_RANK
from training.cluster.requeue import requeue, requeue_history
from training.cluster.signals import WARNING_SIGNALS
from training.errors import UserError
from training.run.dir import RunDir
from training.run.layout import LOG_FILE
from training.sweep.launch import config_hashes, identity, train
from training.sweep.runner import claimed, status_table
from training.sweep.spec import Run, Spec, load_spec
from training.sweep.state import write_json, write_state

log = logging.getLogger("training.sweep.slurm")  # also when run as __main__ (the array task)

SLURM_KEYS = ("nodes", "gpus_per_node", "cpus_per_task", "mem", "time", "partition", "account", "max_parallel",
              "signal_seconds", "signal", "max_requeues", "extra", "setup")
_PLAIN = re.compile(r"^[A-Za-z0-9_.,:%/@+=-]+$")  # an #SBATCH value that needs no quotes
# How srun reports a task killed from outside (kill -9, a lost node) rather than one that failed by itself.
SRUN_KILLED = re.compile(r"srun: error: \S+: tasks? [\d,-]+: Killed")
SRUN_FAILED = re.compile(r"srun: error: \S+: tasks? [\d,-]+: Exited with exit code [1-9]")


def resources(spec: Spec) -> dict[str, Any]:
    res = dict(spec.slurm)
    unknown = sorted(set(res) - set(SLURM_KEYS))
    if unknown:
        raise UserError(f"sweep spec '{spec.path}': unknown slurm key {unknown[0]!r}; valid: {', '.join(SLURM_KEYS)}")
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "max_parallel", "signal_seconds", "max_requeues"):
        if key in res and (not isinstance(res[key], int) or isinstance(res[key], bool) or res[key] < 0):
            raise UserError(f"sweep spec '{spec.path}': slurm.{key} {res[key]!r} must be a non-negative integer")
    if res.get("signal", "USR1") not in WARNING_SIGNALS:
        raise UserError(f"sweep spec '{spec.path}': slurm.signal {res['signal']!r} must be one of "
                        f"{', '.join(WARNING_SIGNALS)}")
    for key in ("extra", "setup"):
        if not isinstance(res.get(key, []), list):
            raise UserError(f"sweep spec '{spec.path}': slurm.{key} must be a list of strings, got {res[key]!r}")
    return res


def _option(spec: Spec, name: str, value: Any) -> str:
    """`--name=value` for an #SBATCH line, the value double-quoted unless it is plain (sbatch reads double-quoted
    values; it has no escape for a double quote, and a line break would end the line: such a value is refused,
    naming it)."""
    text = str(value)
    if any(c in text for c in '"\n\r\\'):
        raise UserError(f"sweep spec '{spec.path}': {name} {text!r} cannot be written into an #SBATCH line (it holds a "
                        "double quote, a backslash or a line break): choose another value")
    return f"--{name}={text}" if _PLAIN.match(text) else f'--{name}="{text}"'


def script(spec: Spec, tasks_file: Path, n: int, max_parallel: int | None) -> str:
    """The sbatch script of an array of `n` tasks (every value quoted; see `_option`)."""
    res = resources(spec)
    nodes, gpus = res.get("nodes", 1) or 1, res.get("gpus_per_node", 0)
    limit = max_parallel or res.get("max_parallel")
    opts = [_option(spec, "job-name", f"sweep-{spec.name}"), f"--array=0-{n - 1}" + (f"%{limit}" if limit else ""),
            f"--nodes={nodes}", f"--ntasks-per-node={max(gpus, 1)}",
            _option(spec, "output", spec.sweep_dir / "slurm" / "%A_%a.out"), "--open-mode=append", "--requeue",
            f"--signal=B:{res.get('signal', 'USR1')}@{res.get('signal_seconds', 120)}",
            _option(spec, "chdir", Path.cwd())]
    opts += [f"--gpus-per-node={gpus}"] if gpus else []
    opts += [_option(spec, key.replace("_", "-"), res[key]) for key in ("cpus_per_task", "mem", "time", "partition",
                                                                        "account") if res.get(key) is not None]
    for extra in map(str, res.get("extra", [])):
        if "\n" in extra or "\r" in extra:
            raise UserError(f"sweep spec '{spec.path}': slurm.extra {extra!r} holds a line break: one option per item")
        opts.append(extra)
    task = [sys.executable, "-m", "training.sweep.slurm", str(tasks_file), "$SLURM_ARRAY_TASK_ID"]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             "# Each task trains one run of the sweep (training/sweep/slurm.py); the warning signal before the time",
             "# limit makes it save, requeue the job and resume.", *map(str, res.get("setup", [])),
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
        write_json(tasks_file, tasks_document(spec, todo))
        script_file = slurm_dir / f"array-{stamp}.sbatch"
        write_text_atomic(script_file, script(spec, tasks_file, len(todo), max_parallel))
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


def tasks_document(spec: Spec, todo: list[Run]) -> dict[str, Any]:
    """The tasks file: the spec, the runs in array order, and what each must train — its command and the `-c`
    files' hashes as submitted (`check_submitted`)."""
    hashes = config_hashes(spec)
    return {"spec_path": str(spec.path.absolute()), "runs": [r.rel for r in todo],
            "submitted": {r.rel: {"command": r.command, "config_hashes": hashes} for r in todo}}


def wait_for(job: str, poll: float = 5.0) -> None:
    """Until no task of the array is pending, running or requeued (squeue lists none)."""
    while True:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True)
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(poll)


class _Task:
    """The signal handling of one array task around its fit: a warning (the spec's signal) or SIGTERM to the
    task is passed on to the fit as the warning signal — to srun, which forwards it to every rank; never SIGTERM
    to srun, which would kill the ranks at once."""

    def __init__(self, warning: signal.Signals) -> None:
        self.warning = warning
        self.proc: subprocess.Popen | None = None
        self.received: list[int] = []

    def handle(self, signum: int, _frame: Any) -> None:
        self.received.append(signum)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.warning)

    def started(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.received:  # the signal came while the fit was starting (its handlers go in first thing)
            proc.send_signal(self.warning)


def check_submitted(spec: Spec, run: Run, submitted: dict[str, Any] | None) -> None:
    """Refuse (one line) to train `run` if its command or a `-c` file differs from what was submitted."""
    if submitted is None:
        return  # a tasks file written before this check existed
    changed = [] if identity(run.command) == identity(submitted["command"]) else ["its command"]
    now = config_hashes(spec)
    changed += [f"{edited_name(c)} (edited)" for c, h in submitted["config_hashes"].items() if now.get(c) != h]
    if changed:
        raise UserError(f"run {run.rel}: {' and '.join(changed)} changed since the array was submitted; not "
                        f"training it with a config it was not submitted with — restore the spec '{spec.path}' and "
                        "its config files, or cancel the array and submit again")


def lost_rank(returncode: int, run_dir: Path, log_from: int) -> bool:
    """Whether the attempt ended because a rank was lost — killed from outside (a node's processes, kill -9) or
    left behind by a hung peer (cluster.LOST_RANK) — rather than failing by itself."""
    if returncode < 0 and returncode != -signal.SIGTERM:
        return True  # one process, killed by a signal
    with open(run_dir / LOG_FILE, "rb") as f:
        f.seek(log_from)
        text = f.read().decode(errors="replace")
    return LOST_RANK in text or (SRUN_KILLED.search(text) is not None and SRUN_FAILED.search(text) is None)


def task_main(argv: list[str]) -> int:
    """`python -m training.sweep.slurm TASKS_JSON INDEX`: train one run; requeue the job if a rank was lost."""
    tasks = json.loads(Path(argv[0]).read_text())
    spec = load_spec(tasks["spec_path"])
    runs = spec.runs()
    rel = tasks["runs"][int(argv[1])]
    run = next((r for r in runs if r.rel == rel), None)
    if run is None:
        raise UserError(f"run {rel} is no longer in the spec '{spec.path}' (edited since the array was submitted); "
                        "restore the spec or cancel the array")
    submitted = tasks.get("submitted", {}).get(rel)
    check_submitted(spec, run, submitted)
    res = resources(spec)
    warning = signal.Signals[f"SIG{res.get('signal', 'USR1')}"]
    task = _Task(warning)
    for s in (warning, signal.SIGTERM):
        signal.signal(s, task.handle)
    procs = (res.get("nodes", 1) or 1) * max(res.get("gpus_per_node", 0), 1)
    prefix = ["srun", "--kill-on-bad-exit=1", "--export=ALL"] if procs > 1 else None
    max_requeues = res.get("max_requeues", 3)
    # The fit requeues the job itself after a warning (rank 0, once its checkpoint is complete).
    cluster_args = [f"--cluster.signal={res.get('signal', 'USR1')}", f"--cluster.max_requeues={max_requeues}"]
    run_dir = spec.sweep_dir / run.rel
    log_path = run_dir / LOG_FILE
    log_from = log_path.stat().st_size if log_path.exists() else 0
    on_change = lambda *_: write_state(spec, runs)  # noqa: E731
    status = train(spec, run, started=lambda p: (task.started(p), on_change()), prefix=prefix, extra=cluster_args,
                   hashes=None if submitted is None else submitted["config_hashes"],  # (the fit checks them again)
                   executor="slurm")
    write_state(spec, runs)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    log.info("%s: %s (restart %d)", run.rel, status, restart)
    record = RunDir(run_dir).record or {}
    already = any(r.get("restart") == restart for r in requeue_history(run_dir))  # (the fit's own requeue)
    if status == "failed" and not task.received and not already and lost_rank(record.get("exit_code", 0), run_dir,
                                                                                 log_from):
        step = RunDir(run_dir).progress()[0]
        if requeue(run_dir, step, "a rank was lost", max_requeues):
            return 0
    return 0 if status in ("finished", "diverged", "pending") else 1


if __name__ == "__main__":
    from training.console import setup_logging
    from training.errors import is_user_error, report_user_error

    setup_logging()
    try:
        sys.exit(task_main(sys.argv[1:]))
    except Exception as err:
        if not is_user_error(err):
            raise
        sys.exit(report_user_error("sweep", err))

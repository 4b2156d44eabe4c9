"""Requeueing a Slurm job whose run was stopped short (the warning signal, a lost rank), bounded: the requeues of a
run are recorded in `<run dir>/requeues.json` (job, restart, step, reason, time; read through `RunDir.requeues`)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from data.atomic import write_text_atomic
from training.run.dir import RunDir, RunDirError
from training.run.layout import REQUEUES_FILE

log = logging.getLogger(__name__)


def requeue_history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's requeue record, oldest first. A file that cannot be read, or whose entries are not requeues
    with an integer step, counts as no history (one warning): it only bounds the requeues of a run that makes no
    progress, and refusing the requeue over it would leave a warned job — its checkpoint saved — to end for good.
    The next requeue rewrites it whole (atomically)."""
    try:
        history = list(RunDir(run_dir).requeues)
        if all(isinstance(e, dict) and type(e.get("step")) is int for e in history):
            return history
        problem = f"'{Path(run_dir) / REQUEUES_FILE}' holds entries that are not requeues with an integer 'step'"
    except RunDirError as err:
        problem = str(err).split(";")[0]
    log.warning("%s; counting this run's requeues afresh (the next requeue rewrites it)", problem)
    return []


def requeue(run_dir: Path, step: int, reason: str, max_requeues: int) -> bool:
    """Ask Slurm to requeue this job (`scontrol requeue $SLURM_JOB_ID`), to resume the run in `run_dir` from its
    checkpoint at `step` — unless it has been requeued `max_requeues` times in a row without getting past `step`.
    One log line either way; returns whether the job was requeued."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        log.warning("%s at step %d, but this is not a Slurm job: not requeued (resume with --ckpt_path last)",
                    reason, step)
        return False
    history = requeue_history(run_dir)
    stalled = 0
    for entry in reversed(history):
        if entry["step"] < step:
            break
        stalled += 1
    if stalled >= max_requeues:
        log.error("%s: requeued %d times in a row without getting past step %d; not requeued again (the run's log "
                  "says why; cluster.max_requeues allows more)", run_dir, stalled, step)
        return False
    history.append({"job": job, "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "step": step,
                    "reason": reason, "time": time.time()})
    try:
        write_text_atomic(Path(run_dir) / REQUEUES_FILE, json.dumps(history, indent=1) + "\n")
    except OSError as err:  # e.g. a directory in its place: unbounded requeues are worse than none
        log.error("cannot record the requeue in %s (%s): job %s not requeued; remove or fix that path, then resume "
                  "with --ckpt_path last", Path(run_dir) / REQUEUES_FILE, err, job)
        return False
    # Logged first: a successful requeue ends this job at once (Slurm signals its processes).
    log.info("%s at step %d: requeueing job %s (restart %d)", reason, step, job, len(history))
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.error("scontrol is not on the PATH: job %s not requeued (resume with --ckpt_path last)", job)
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, " ".join(out.stderr.split()))
        return False
    return True

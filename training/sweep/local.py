"""The local executor: up to `max_parallel` runs at once on this machine, each on its own CPUs or GPUs.

Each slot owns a disjoint share of the machine: with GPUs, a slice of them (CUDA_VISIBLE_DEVICES); without,
a slice of the CPU cores (the process's affinity) and as many intra-op threads (OMP_NUM_THREADS, which torch
reads at start-up) — so two runs never fight over one core and a run's speed does not depend on its neighbour.
Runs are independent processes: one that diverges or crashes is recorded and the others go on.

The fit processes stay in the sweep's process group, so Ctrl-C (or `kill -- -PGID`) reaches them all; on SIGTERM
the executor also forwards SIGTERM to each run, which saves its step and exits (training/callbacks/
stop_signals.py); on either it starts no new run. After a `kill -9` the next sweep resumes the interrupted runs.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from training.errors import UserError
from training.rundir import RunDir
from training.sweep.launch import train
from training.sweep.spec import Run, Spec
from training.sweep.state import LOG_FILE

log = logging.getLogger(__name__)


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else those nvidia-smi lists."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def slots(max_parallel: int) -> list[dict[str, Any]]:
    """One resource share per parallel run: {"env": ..., "cpus": [...] or None}."""
    gpus = visible_gpus()
    if gpus:
        if max_parallel > len(gpus):
            raise UserError(f"--max_parallel {max_parallel} needs at least as many GPUs; {len(gpus)} are visible "
                            f"({','.join(gpus)}): lower --max_parallel")
        per = len(gpus) // max_parallel
        return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])}, "cpus": None}
                for i in range(max_parallel)]
    if max_parallel == 1:
        return [{"env": {}, "cpus": None}]  # the whole machine, as a plain `normlab fit` would have it
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // max_parallel)
    shares = [cores[(i * per) % len(cores):][:per] for i in range(max_parallel)]
    return [{"env": {"OMP_NUM_THREADS": str(len(c)), "MKL_NUM_THREADS": str(len(c))}, "cpus": c} for c in shares]


class LocalExecutor:
    def __init__(self, spec: Spec, max_parallel: int, on_change: Callable[[], None]) -> None:
        if max_parallel < 1:
            raise UserError(f"--max_parallel {max_parallel} must be >= 1")
        self.spec, self.on_change = spec, on_change
        self.slots = slots(max_parallel)
        self.stopping = threading.Event()
        self.procs: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.results: dict[str, str] = {}

    def _stop(self, signum: int, _frame: Any) -> None:
        self.stopping.set()
        if signum != signal.SIGTERM:
            return  # Ctrl-C reached the runs from the terminal already; a second one would abort them unsaved
        with self.lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # each run saves its step and exits 0

    def _worker(self, slot: dict[str, Any], todo: queue.Queue) -> None:
        while not self.stopping.is_set():
            try:
                run: Run = todo.get_nowait()
            except queue.Empty:
                return

            def started(proc: subprocess.Popen) -> None:
                if slot["cpus"]:
                    try:  # right after the start, before torch creates its thread pools
                        os.sched_setaffinity(proc.pid, slot["cpus"])
                    except OSError:
                        pass  # the run finished already, or the platform refuses: it shares the cores
                with self.lock:
                    self.procs[proc.pid] = proc
                if self.stopping.is_set():
                    proc.send_signal(signal.SIGTERM)
                self.on_change()

            log.info("start %s", run.rel)
            status = train(self.spec, run, env=slot["env"], started=started)
            with self.lock:
                self.procs = {pid: p for pid, p in self.procs.items() if p.poll() is None}
                self.results[run.rel] = status
            if status in ("failed", "diverged"):
                record = RunDir(self.spec.sweep_dir / run.rel).record or {}
                log.warning("%s %s: %s (log: %s)", run.rel, status, record.get("error"),
                            self.spec.sweep_dir / run.rel / LOG_FILE)
            else:
                log.info("%s: %s", run.rel, status)
            self.on_change()

    def run(self, runs: list[Run]) -> dict[str, str]:
        """Train `runs` (those not finished), at most len(slots) at once; returns each one's status."""
        todo: queue.Queue = queue.Queue()
        for run in runs:
            todo.put(run)
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            threads = [threading.Thread(target=self._worker, args=(slot, todo), daemon=True) for slot in self.slots]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)  # a timed join lets the main thread take signals
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.results

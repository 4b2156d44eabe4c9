"""The local executor: up to `max_parallel` runs at once on this machine, each on its own CPUs or GPUs.

Each slot owns a disjoint share of the machine: with GPUs, a slice of them (CUDA_VISIBLE_DEVICES); without,
a slice of the CPU cores (the process's affinity) and as many intra-op threads (OMP_NUM_THREADS, which torch
reads at start-up) — so two runs never fight over one core and a run's speed does not depend on its neighbour.
Runs are independent processes: one that diverges or crashes is recorded and the others go on.

The fit processes stay in the sweep's process group, so Ctrl-C (or `kill -- -PGID`) reaches them all; on SIGTERM
the executor also forwards SIGTERM to each run, which saves its step and exits (training/cluster/signals.py); on
either it starts no new run. After a `kill -9` the next sweep resumes the interrupted runs.

It prints one line per event of a run — started, up (its first TensorBoard event: start-up over), a new
checkpoint, its end — with the run's step and time and the sweep's done count and ETA (training/sweep/
progress.py: the same numbers as `--status`).
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from training.errors import UserError
from training.run.dir import RunDir
from training.run.layout import LOG_FILE
from training.sweep import progress
from training.sweep.launch import Snapshot, train
from training.sweep.spec import Run, Spec

POLL_SECONDS = 2.0  # how often running runs are looked at for their start-up and checkpoints

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


class Progress:
    """The progress lines of a local sweep: one per event of a run, numbers from the run directories."""

    def __init__(self, spec: Spec, runs: list[Run], n_slots: int) -> None:
        self.spec, self.runs, self.slots = spec, runs, n_slots
        self.lock = threading.Lock()
        self.live: set[str] = set()  # the runs this process is training
        self.seen: dict[str, tuple[float | None, int]] = {}  # rel → (its start-up in s once up, step) as printed

    def started(self, run: Run) -> None:
        with self.lock:
            self.live.add(run.rel)
            self.seen[run.rel] = (None, RunDir(self.spec.sweep_dir / run.rel).progress()[0])
            self._print(run, "started")

    def ended(self, run: Run, status: str) -> None:
        """The run's outcome, with its start-up (seen while it ran)."""
        with self.lock:
            self.live.discard(run.rel)
            up = self.seen.get(run.rel, (None, 0))[0]
            what = "interrupted" if status == "pending" else status  # (the next sweep resumes it)
            self._print(run, what + ("" if up is None else f" (start-up {progress.duration(up)})"))

    def poll(self) -> None:
        """A line for each running run that came up or reached a new checkpoint since the last look."""
        with self.lock:
            for rel in list(self.live):
                run = next(r for r in self.runs if r.rel == rel)
                now = progress.view(self.spec, run)
                up, step = self.seen[rel]
                if up is None and now.up is not None:
                    self._print(run, f"up after {progress.duration(now.up)}")
                elif now.step != step:
                    self._print(run, "checkpoint")
                self.seen[rel] = (up if up is not None else now.up, now.step)

    def _print(self, run: Run, what: str) -> None:
        now = time.time()
        views = [progress.view(self.spec, r) for r in self.runs]
        mine = next(v for v in views if v.rel == run.rel)
        log.info("%s", progress.line(mine, what, views, self.slots, now))


class LocalPool:
    """Trains runs on this machine. With a `snapshot` (launch.Snapshot), each run is checked against it right
    before it starts and trains with its `-c` hashes: a changed config starts neither that run nor any later one
    (the runs already started go on), and the refusal is kept in `refused`."""

    def __init__(self, spec: Spec, max_parallel: int, on_change: Callable[[], None],
                 snapshot: Snapshot | None = None) -> None:
        self.spec, self.on_change, self.snapshot = spec, on_change, snapshot
        self.refused: UserError | None = None
        self.slots = slots(max_parallel)
        self.stopping = threading.Event()
        self.procs: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.results: dict[str, str] = {}
        self.progress = Progress(spec, spec.runs(), len(self.slots))

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

            def started(proc: subprocess.Popen, run: Run = run) -> None:
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
                self.progress.started(run)

            try:
                if self.snapshot is not None:
                    self.snapshot.check(run)
            except UserError as err:
                with self.lock:
                    self.refused = self.refused or err
                self.stopping.set()
                return
            # (a fit here never requeues a Slurm job around the sweep: the sweep decides what runs next)
            status = train(self.spec, run, env=slot["env"], started=started, extra=["--cluster.requeue=false"],
                           hashes=None if self.snapshot is None else self.snapshot.hashes)
            with self.lock:
                self.procs = {pid: p for pid, p in self.procs.items() if p.poll() is None}
                self.results[run.rel] = status
            self.on_change()
            self.progress.ended(run, status)
            if status in ("failed", "diverged"):
                record = RunDir(self.spec.sweep_dir / run.rel).record or {}
                log.warning("%s %s: %s (log: %s)", run.rel, status, record.get("error"),
                            self.spec.sweep_dir / run.rel / LOG_FILE)

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
            last_poll = time.monotonic()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)  # a timed join lets the main thread take signals
                    if time.monotonic() - last_poll >= POLL_SECONDS:
                        self.progress.poll()
                        last_poll = time.monotonic()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.results

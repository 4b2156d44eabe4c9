"""Running the grid: every (spec, seed) job of the selected claims, in this process or in `jobs` worker
processes, then the measurements that must run alone (op timing, the profiler) in this process.

Jobs are independent — each builds its model from its seed and reads batches from its own loader — so the
results do not depend on `jobs`. Workers are spawned (not forked: a forked child inherits the parent's OpenMP
thread pool state) and run one intra-op thread each, so `jobs` processes use `jobs` cores.
"""
from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from data.datamodule import TokenDataModule
from training.study.claims import Claim
from training.study.grid import AtInit, Scale, Spec, shallow
from training.study.measure import at_init, toy_no_norm, train_run
from training.study.timing import norm_share, op_ratios

log = logging.getLogger(__name__)
_WORKER: dict = {}


def roles_of(claims: tuple[Claim, ...], scale: Scale) -> dict[int, dict[str, Spec]]:
    return {c.number: c.setup(scale) for c in claims}


def plan(claims: tuple[Claim, ...], scale: Scale) -> list[tuple[Spec, int]]:
    """The union of the selected claims' specs, each at its number of seeds, longest jobs first."""
    specs: dict[Spec, None] = {}
    for roles in roles_of(claims, scale).values():
        specs.update(dict.fromkeys(roles.values()))
    jobs = [(s, seed) for s in specs for seed in range(scale.init_seeds if isinstance(s, AtInit) else scale.seeds)]
    return sorted(jobs, key=lambda j: -_cost(j[0]))


def _cost(spec: Spec) -> float:
    return spec.arch.layers * (1 if isinstance(spec, AtInit) else spec.steps)


def load_data(data_dir: Path, scale: Scale) -> TokenDataModule:
    data = TokenDataModule(str(data_dir), seq_len=scale.seq_len, batch_size=scale.batch_size, val_batches=0)
    data.setup("fit")
    return data


def _init_worker(data_dir: str, scale: Scale, threads: int) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    _WORKER["data"], _WORKER["scale"] = load_data(Path(data_dir), scale), scale


def first_batch(data: TokenDataModule) -> torch.Tensor:
    return next(iter(data.train_dataloader()))


def _job(spec: Spec, seed: int) -> tuple[Spec, int, dict]:
    data, scale = _WORKER["data"], _WORKER["scale"]
    if isinstance(spec, AtInit):
        return spec, seed, at_init(spec, seed, scale, first_batch(data), data.vocab_size)
    return spec, seed, train_run(spec, seed, scale, iter(data.train_dataloader()), data.vocab_size)


def run_jobs(jobs: list[tuple[Spec, int]], data_dir: Path, scale: Scale, n_procs: int) -> dict[Spec, list[dict]]:
    """Every job's result, grouped by spec in seed order."""
    out: dict[Spec, dict[int, dict]] = {}
    start, done = time.perf_counter(), 0

    def collect(spec: Spec, seed: int, result: dict) -> None:
        nonlocal done
        out.setdefault(spec, {})[seed] = result
        done += 1
        log.info("[%d/%d %.0fs] %s seed %d", done, len(jobs), time.perf_counter() - start, spec.label(), seed)

    if n_procs <= 1:
        _init_worker(str(data_dir), scale, torch.get_num_threads())
        for spec, seed in jobs:
            collect(*_job(spec, seed))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(n_procs, mp_context=ctx, initializer=_init_worker,
                                 initargs=(str(data_dir), scale, 1)) as pool:
            for fut in [pool.submit(_job, spec, seed) for spec, seed in jobs]:
                collect(*fut.result())
    return {spec: [by_seed[s] for s in sorted(by_seed)] for spec, by_seed in out.items()}


def main_process_measurements(claims: tuple[Claim, ...], scale: Scale, data: TokenDataModule) -> dict:
    """Measurements that run alone, after the grid: the toy (claim 9) and claim 7's op timing and profiler
    share (one thread, so the timing is not split across cores with anything of ours)."""
    numbers = {c.number for c in claims}
    extra: dict = {}
    if 9 in numbers:
        extra["toy"] = toy_no_norm()
    if 7 in numbers:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            shape = (8, 512, 768) if scale.dim >= 64 else (4, 64, 128)
            extra["op_ratios"] = op_ratios(shape, scale.timing_rounds)
            extra["op_shape"] = shape
            tokens = first_batch(data)
            extra["norm_share"] = {
                "rmsnorm": norm_share(shallow(scale, bias=True), scale, data.vocab_size, tokens),
                "layernorm": norm_share(shallow(scale, norm="layernorm", bias=True), scale, data.vocab_size,
                                        tokens)}
        finally:
            torch.set_num_threads(threads)
    return extra

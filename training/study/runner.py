"""Running the grid: every (spec, seed) job of the selected claims, in this process or in `jobs` worker
processes, then the measurements that must run alone (op timing, the profiler) in this process.

Jobs are independent — each builds its model from its seed and reads batches from its own loader — so the
results do not depend on `jobs`. Workers are spawned (not forked: a forked child inherits the parent's OpenMP
thread pool state) and run one intra-op thread each, so `jobs` processes use `jobs` cores.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from data.datamodule import TokenDataModule
from data.entropy import unigram_entropy
from training.study.claims import Claim, used_roles
from training.study.grid import AtInit, Job, Scale, shallow
from training.study.measure import UNIGRAM_ENTROPY, at_init, toy_no_norm, train_run
from training.study.timing import norm_time_ratios, op_ratios, step_time_ratios

log = logging.getLogger(__name__)
_WORKER: dict = {}


def roles_of(claims: tuple[Claim, ...], scale: Scale) -> dict[int, dict[str, Job]]:
    return {c.number: used_roles(c, c.setup(scale)) for c in claims}


def claim_jobs(claims: tuple[Claim, ...], scale: Scale) -> list[tuple[Job, int]]:
    """The union of the selected claims' specs, each at its number of seeds, longest jobs first."""
    specs: dict[Job, None] = {}
    for roles in roles_of(claims, scale).values():
        specs.update(dict.fromkeys(roles.values()))
    jobs = [(s, seed) for s in specs for seed in scale.seed_range(seeds_of(s, scale))]
    return sorted(jobs, key=lambda j: -_cost(j[0], scale))


def seeds_of(spec: Job, scale: Scale) -> int:
    if isinstance(spec, AtInit):
        return scale.ladder_seeds if spec.ladder else scale.init_seeds
    return scale.seeds


def _cost(spec: Job, scale: Scale) -> float:
    width = (spec.arch.dim or scale.dim) ** 2
    return spec.arch.layers * width * (1 if isinstance(spec, AtInit) else spec.steps)


def load_data(data_dir: Path, scale: Scale) -> TokenDataModule:
    data = TokenDataModule(str(data_dir), seq_len=scale.seq_len, batch_size=scale.batch_size,
                           val_batches=scale.val_batches)
    data.setup("fit")
    return data


def data_entropy(data: TokenDataModule) -> float:
    """The unigram entropy (nats) of the study's training tokens: the plateau every trained run is judged
    against (`training.stats.on_plateau`); counted once per data directory (`data.entropy`)."""
    return unigram_entropy([(path, weight) for _, path, weight in data.sources])


def held_out(data: TokenDataModule) -> list[torch.Tensor]:
    """The held-out batches every trained run is scored on (the validation split; the same for every seed)."""
    loader = data.val_dataloader()
    loader = loader[0] if isinstance(loader, list) else loader
    return [b if torch.is_tensor(b) else b[0] for b in loader]


def training_batches(data: TokenDataModule, seed: int):
    """The training batches of seed `seed`: the data order is the seed's (so is the initialization)."""
    data.seed = seed
    return iter(data.train_dataloader())


def _init_worker(data_dir: str, scale: Scale, threads: int) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    data = load_data(Path(data_dir), scale)
    _WORKER.update(data=data, scale=scale, val=held_out(data), first=first_batch(data), entropy=data_entropy(data))


def first_batch(data: TokenDataModule) -> torch.Tensor:
    return next(training_batches(data, 0))


def _job(spec: Job, seed: int) -> tuple[Job, int, dict]:
    data, scale = _WORKER["data"], _WORKER["scale"]
    if isinstance(spec, AtInit):
        return spec, seed, at_init(spec, seed, scale, _WORKER["first"], data.vocab_size)
    result = train_run(spec, seed, scale, training_batches(data, seed), _WORKER["val"], data.vocab_size)
    result[UNIGRAM_ENTROPY] = _WORKER["entropy"]  # each run carries its plateau, so a rejudge needs no data
    return spec, seed, result


def run_jobs(jobs: list[tuple[Job, int]], data_dir: Path, scale: Scale, n_procs: int) -> dict[Job, list[dict]]:
    """Every job's result, grouped by spec in seed order."""
    out: dict[Job, dict[int, dict]] = {}
    start, done = time.perf_counter(), 0

    def collect(spec: Job, seed: int, result: dict) -> None:
        nonlocal done
        out.setdefault(spec, {})[seed] = result
        done += 1
        if done % max(1, len(jobs) // 20) == 0 or done == len(jobs):  # ~20 progress lines per study
            log.info("[%d/%d %.0fs] %s seed %d", done, len(jobs), time.perf_counter() - start, spec.label(), seed)

    logging.getLogger("data.datamodule").setLevel(logging.WARNING)  # one "train data" line per run is noise here
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
    """Measurements that run alone, after the grid: the unigram entropy of the training data, the toy (claim 9)
    and the timing of claims 20 and 21 (one thread, so the timing is not split across cores with anything of
    ours)."""
    numbers = {c.number for c in claims}
    extra: dict = {UNIGRAM_ENTROPY: data_entropy(data)}  # the plateau of every trained run, on the record
    if 9 in numbers:
        extra["toy"] = toy_no_norm()
    if not numbers & {20, 21}:
        return extra
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    timing: dict[str, list[float]] = {}
    tokens = first_batch(data)
    small = shallow(scale, bias=True)
    wide = shallow(scale, bias=True, dim=scale.wide_dim)
    runs = scale.timing_runs
    rounds = max(2, scale.timing_rounds // runs)  # the rounds of one timing run: the total stays the scale's
    try:
        if 20 in numbers:
            timing["qk_step"] = step_time_ratios(replace(small, qk_norm="head"), small, scale, data.vocab_size,
                                                 tokens, rounds, runs)
            timing["qk_step_wide"] = step_time_ratios(replace(wide, qk_norm="head"), wide, scale, data.vocab_size,
                                                      tokens, max(2, rounds // 3), runs)
        if 21 in numbers:
            big = (8, 512, 768) if scale.dim >= 64 else (4, 64, 128)
            timing |= op_ratios(big, rounds, runs)
            timing["fused_small"] = op_ratios((scale.batch_size, scale.seq_len, scale.dim), rounds, runs).get(
                "fused", [math.nan])
            extra["op_shape"] = big
            share: dict[str, list[float]] = {}
            for name, arch in (("", small), ("_wide", wide)):
                timing["norm_time" + name], shares = norm_time_ratios(arch, scale, data.vocab_size, tokens, rounds,
                                                                      runs)
                share |= {norm + name: values for norm, values in shares.items()}
            extra["norm_share"] = share
    finally:
        torch.set_num_threads(threads)
    extra["timing"] = timing
    return extra

"""Downstream tasks (lm-evaluation-harness, the optional `[eval]` extra): which tasks, their numbers, where they go.

One path for every way a task is scored — in the training loop (`training/callbacks/downstream.py`), on one
checkpoint and over a run's history (`normlab evaluate --tasks`):

    TaskSet.load(names, ...)      the harness's tasks, read once (from its datasets cache) and reused
    score(lm, task_set)           the harness's `evaluate` on a `NormlabLM`, every item (per-item log-likelihoods)
    task_metrics(results, ...)    per task: `acc`, `acc_norm` where the task has it, and `bpb`
    record(run_dir, step, ...)    runs/NAME/eval/lm_eval/step-XXXXXXXX.json, eval/lm_eval.csv, TensorBoard tags
                                  `eval/<task>/acc|acc_norm|bpb` at the step

`bpb` is the bits per byte of the gold continuation: for each item, −log p(gold continuation | context) / ln 2
divided by the UTF-8 bytes of that continuation (as the harness passes it, target delimiter included), averaged
over the items. Unlike accuracy, which sits at chance for most tasks below ~1B parameters, it moves from the
first steps. Multiple-choice and loglikelihood tasks have it; rolling tasks report the harness's own
`bits_per_byte`.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lm_eval import utils
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

from data.atomic import write_text_atomic
from training.errors import UserError
from training.eval import history
from training.loggers import write_scalars
from training.run.dir import RunDir
from training.run.layout import CHECKPOINTS_DIR, CONFIG_FILE, EVENTS_GLOB, MANIFEST, TMP_PREFIX, step_of_name

log = logging.getLogger(__name__)

HARNESS_DIR = "lm_eval"  # runs/NAME/eval/lm_eval/step-XXXXXXXX.json and runs/NAME/eval/lm_eval.csv
FEWSHOT_SEED = 1234  # the harness's default fewshot_random_seed: the same few-shot contexts as `simple_evaluate`
METRICS = ("acc", "acc_norm", "bpb")
LOGLIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


@dataclass
class TaskSet:
    """Harness tasks loaded once, with the settings their numbers depend on."""

    names: list[str]
    num_fewshot: int | None
    limit: int | None
    include_path: str | None
    loaded: dict[str, Any] = field(repr=False)

    @classmethod
    def load(cls, names: list[str], num_fewshot: int | None = None, limit: int | None = None,
             include_path: str | None = None, loglikelihood_only: bool = False) -> TaskSet:
        """The tasks `names` (harness names or those of YAML files under `include_path`), configured as the
        harness's `simple_evaluate` configures them. `loglikelihood_only`: refuse generation tasks (the loop)."""
        if include_path is not None:
            check_include_path(Path(include_path))
        manager = TaskManager(include_path=include_path)
        unknown = [t for t in names if not manager.match_tasks([t])]
        if unknown:
            raise UserError(f"tasks: unknown task {unknown[0]!r}; `lm-eval ls tasks` lists the harness's tasks, and "
                             "an include path (a directory of your own YAML task definitions) adds yours")
        try:
            loaded = manager.load(names)
        except Exception as err:  # the harness reads the task's data here: offline, it must be cached already
            raise UserError(f"tasks {','.join(names)}: the harness could not load them ({type(err).__name__}: "
                             f"{err}); offline, pre-cache their data on a machine with network first (see "
                             "docs/downstream.md)") from err
        for name, task in loaded["tasks"].items():
            if loglikelihood_only and task.OUTPUT_TYPE not in LOGLIKELIHOOD_TYPES:
                raise UserError(f"eval.tasks: {name!r} is a {task.OUTPUT_TYPE} task; the training loop scores "
                                 f"log-likelihood tasks only ({', '.join(LOGLIKELIHOOD_TYPES)}): evaluate it on "
                                 "checkpoints with `normlab evaluate --tasks`")
            if num_fewshot is not None and task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=num_fewshot)
            elif task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
        return cls(sorted(names), num_fewshot, limit, include_path, loaded)

    def settings(self) -> dict[str, Any]:
        """What the numbers depend on besides the weights (a history skips steps scored with equal settings)."""
        return {"tasks": self.names, "num_fewshot": self.num_fewshot, "limit": self.limit,
                "include_path": str(Path(self.include_path).resolve()) if self.include_path else None}


def check_include_path(path: Path) -> None:
    """Refuse an include path that is, is inside, or holds a run or checkpoint directory. A task YAML there may say
    `!function module.name`, which the harness imports from the YAML's directory — Python that runs. The include
    path is the user's own code; a run or checkpoint directory is data that others (a copied run, a downloaded
    checkpoint) shaped, so task files are never read from one."""
    if not path.is_dir():
        raise UserError(f"include_path: '{path}' is not a directory of task YAML files")
    path = path.resolve()
    inside = next((p for p in (path, *path.parents) if _normlab_dir(p)), None)
    below = None if inside else next((Path(d) for d, _, _ in os.walk(path) if _normlab_dir(Path(d))), None)
    if inside or below:
        where = f"is inside {inside}" if inside else f"holds {below}"
        raise UserError(f"include_path: '{path}' {where}, a normlab run or checkpoint directory; task YAML files can "
                        "import and run Python (`!function`), so they are never read from one — keep your task "
                        "definitions in a directory of their own and pass that")


def _normlab_dir(path: Path) -> bool:
    """Whether `path` is a checkpoint (a manifest) or a run (its checkpoints, or its config beside TensorBoard
    events) — not merely a directory with a config.yaml, as many projects have."""
    checkpoints = path / CHECKPOINTS_DIR
    return ((path / MANIFEST).is_file()
            or (checkpoints.is_dir() and any(step_of_name(p.name) is not None or p.name.startswith(TMP_PREFIX)
                                             for p in checkpoints.iterdir()))
            or ((path / CONFIG_FILE).is_file() and any(path.glob(EVENTS_GLOB))))


def score(lm: Any, task_set: TaskSet) -> dict[str, Any]:
    """The harness's results for `task_set` on `lm` (a `NormlabLM`), with every item's responses (`samples`)."""
    for task in task_set.loaded["tasks"].values():
        task.set_fewshot_seed(seed=FEWSHOT_SEED)  # the same few-shot contexts at every evaluation
    return evaluate(lm=lm, task_dict=task_set.loaded, limit=task_set.limit, log_samples=True, bootstrap_iters=0)


def gold_index(task: Any, sample: dict[str, Any]) -> int:
    """Which of a multiple-choice item's continuations is the answer (the first, when a task lists several)."""
    target = sample["target"]
    if isinstance(target, list):
        target = target[0]
    if isinstance(target, str):
        return list(task.doc_to_choice(sample["doc"])).index(target)
    return int(target)


def gold_bpb(task: Any, samples: list[dict[str, Any]]) -> float | None:
    """Mean over items of the gold continuation's bits per byte (None for tasks without one continuation)."""
    per_item = []
    for sample in samples:
        gold = gold_index(task, sample) if task.OUTPUT_TYPE == "multiple_choice" else 0
        _, continuation = sample["arguments"][gold][:2]
        loglikelihood = sample["resps"][gold][0][0]
        per_item.append(-loglikelihood / math.log(2) / max(len(continuation.encode("utf-8")), 1))
    return sum(per_item) / len(per_item) if per_item else None


def task_metrics(results: dict[str, Any], task_set: TaskSet) -> dict[str, dict[str, float]]:
    """{task: {"acc", "acc_norm" (where the task has it), "bpb"}} from `score`'s results."""
    out: dict[str, dict[str, float]] = {}
    for name, task in task_set.loaded["tasks"].items():
        harness = results["results"].get(name, {})
        values = {key.split(",")[0]: float(v) for key, v in harness.items()
                  if key.split(",")[0] in ("acc", "acc_norm") and isinstance(v, (int, float))}
        if task.OUTPUT_TYPE in ("multiple_choice", "loglikelihood"):
            bpb = gold_bpb(task, results.get("samples", {}).get(name, []))
            if bpb is not None:
                values["bpb"] = bpb
        elif "bits_per_byte,none" in harness:
            values["bpb"] = float(harness["bits_per_byte,none"])
        out[name] = values
    return out


def result_path(run_dir: Path, step: int) -> Path:
    """`runs/NAME/eval/lm_eval/step-XXXXXXXX.json`: where a run's task results go, as the set `lm_eval`."""
    return RunDir(run_dir).eval_file(HARNESS_DIR, step)


def record(path: Path, step: int, metrics: dict[str, dict[str, float]], results: dict[str, Any],
           settings: dict[str, Any], checkpoint: str | None, run_dir: Path | None,
           log_scalars: Callable[[dict[str, float], int], None] | None) -> None:
    """Write one evaluation: its JSON (atomically), the run's CSV, and the tags through `log_scalars` (every
    logger of a training run; the run's TensorBoard events offline)."""
    summary = {"step": step, "checkpoint": checkpoint, "settings": settings, "metrics": metrics,
               "results": {k: v for k, v in results.items() if k != "samples"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(summary, indent=2, default=utils.handle_non_serializable) + "\n")
    if run_dir is not None and path == result_path(run_dir, step):
        write_csv(run_dir)
    tags = {f"eval/{task}/{name}": value for task, values in metrics.items() for name, value in values.items()}
    if log_scalars is not None:
        log_scalars(tags, step)


def write_csv(run_dir: Path) -> Path:
    """`eval/lm_eval.csv`: one row per step and task, from the step files, in step order (rewritten atomically)."""
    run = RunDir(run_dir)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", "task", *METRICS])
    for data in run.eval_results(HARNESS_DIR):
        for task, values in sorted(data.get("metrics", {}).items()):
            writer.writerow([data["step"], task, *(values.get(m, "") for m in METRICS)])
    path = run.eval_csv(HARNESS_DIR)
    write_text_atomic(path, buffer.getvalue())
    return path


def summary_line(metrics: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items())
                     for task, values in sorted(metrics.items()))


def run_tasks(checkpoint: str | Path, tasks: list[str], num_fewshot: int | None = None, limit: int | None = None,
              batch_size: int = 8, device: str | None = None, output: Path | None = None,
              include_path: str | None = None, task_set: TaskSet | None = None) -> dict[str, Any]:
    """Score harness `tasks` on one normlab checkpoint (or export). Results go to `output` (default: the run's
    `eval/lm_eval/step-XXXXXXXX.json`, its CSV and its TensorBoard); returns the harness's results, with every
    item (`samples`) and normlab's per-task `metrics`."""
    import torch

    from training.checkpointing.load import load_checkpoint
    from training.errors import CheckpointError
    from training.eval.harness import NormlabLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    task_set = task_set or TaskSet.load(tasks, num_fewshot, limit, include_path)
    loaded = load_checkpoint(checkpoint, device=device)
    in_run = loaded.run_dir is not None and loaded.step is not None
    if output is None and not in_run:
        raise UserError(f"--tasks: '{checkpoint}' is not a checkpoint of a run; say where the results go with "
                         "--output FILE.json")
    if loaded.tokenizer_path is None or not loaded.tokenizer_path.is_file():
        raise CheckpointError(f"'{checkpoint}': its tokenizer is not found (the run's data directory moved?); "
                              "evaluate an export of it (`normlab export`), which carries the tokenizer")
    lm = NormlabLM(loaded.model.eval(), loaded.tokenizer_path, batch_size, device)
    results = score(lm, task_set)
    metrics = task_metrics(results, task_set)
    step = loaded.step if loaded.step is not None else -1
    # Into the run's own results (and its TensorBoard) unless --output says where else they go.
    to_run = output is None
    record(output or result_path(loaded.run_dir, step), step, metrics, results, task_set.settings(), str(checkpoint),
           loaded.run_dir, partial(write_scalars, loaded.run_dir) if to_run else None)
    log.info("step %s: %s", loaded.step, summary_line(metrics))
    return {**results, "metrics": metrics}


def evaluate_run_tasks(run_dir: str | Path, tasks: list[str], num_fewshot: int | None = None,
                       limit: int | None = None, batch_size: int = 8, device: str | None = None,
                       include_path: str | None = None) -> dict[int, dict[str, dict[str, float]]]:
    """Every complete checkpoint of `run_dir` not yet scored on these tasks with the same settings (by the loop
    or an earlier call), in step order; returns {step: metrics} of the new ones."""
    from training.errors import CheckpointError
    from training.run.layout import checkpoints_dir
    from training.run.manifest import Manifest

    run = RunDir(run_dir)
    checkpoints = run.checkpoints()
    if not checkpoints:
        raise CheckpointError(f"'{run_dir}' holds no complete checkpoint (none in {checkpoints_dir(run_dir)}); "
                              "train it first, or pass one checkpoint directory")
    task_set = TaskSet.load(tasks, num_fewshot, limit, include_path)
    new = {}
    for ckpt in checkpoints:
        step = Manifest.read(ckpt).step
        if history.scored_with(result_path(run_dir, step), task_set.settings()):
            log.info("%s: tasks already scored with these settings, skipped", ckpt.name)
            continue
        new[step] = run_tasks(ckpt, tasks, batch_size=batch_size, device=device, task_set=task_set)["metrics"]
    log.info("results: %s and %s/", run.eval_csv(HARNESS_DIR), run.eval_dir / HARNESS_DIR)
    return new

"""Downstream tasks in the training loop (`--eval.tasks`): lm-evaluation-harness tasks scored on the live model.

    normlab fit ... --eval.tasks arc_easy,piqa --eval.every_n_steps 1000 --eval.limit 500

Every `every_n_steps` optimizer steps (and at the last step) the model as training runs it — the same module,
under the trainer's precision context, no second copy of the weights, under every strategy including ZeRO-3 —
scores the tasks; the batches are dealt out to the ranks and the answers gathered once per request type
(`training/eval/harness.py`). Logged as `eval/<task>/acc`, `acc_norm` where the task has it, and `bpb` (bits per
byte of the gold continuation, `training/eval/tasks.py`) at the step, and written to
`runs/NAME/eval/lm_eval/step-XXXXXXXX.json` and `eval/lm_eval.csv` — the files `normlab evaluate --checkpoint
runs/NAME --tasks ...` writes, so a later history evaluation skips the steps the loop scored with the same
settings. `eval/seconds` is the wall time of each evaluation. The task data is read once, when the fit starts
(offline, from the harness's datasets cache: pre-cache it where there is network).
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from training.cluster import signals
from training.eval import require_harness
from training.loggers import log_scalars

log = logging.getLogger(__name__)


class DownstreamEval(Callback):
    """Harness tasks on the live model every `every_n_steps` optimizer steps (0: never; the default).

    Args:
        include_path: a directory of your own task YAML files. They are code: a task's `!function` imports
            Python from that directory and runs it, so pass only tasks you wrote or trust; a run or checkpoint
            directory is refused.
    """

    def __init__(self, tasks: list[str] | str | None = None, every_n_steps: int = 0, limit: int | None = None,
                 num_fewshot: int | None = None, include_path: str | None = None, batch_size: int = 8) -> None:
        if isinstance(tasks, str):  # `--eval.tasks arc_easy,piqa` as `normlab evaluate --tasks` takes them
            tasks = [t.strip() for t in tasks.split(",") if t.strip()]
        if every_n_steps < 0 or batch_size < 1 or (limit is not None and limit < 1):
            raise ValueError(f"eval: every_n_steps {every_n_steps}, batch_size {batch_size}, limit {limit}: "
                             "every_n_steps must be >= 0, batch_size and limit >= 1")
        if tasks and not every_n_steps:
            raise ValueError(f"eval.tasks {','.join(tasks)} given without eval.every_n_steps: say how often to score "
                             "them (e.g. --eval.every_n_steps 1000)")
        self.tasks, self.every_n_steps, self.limit = list(tasks or []), every_n_steps, limit
        self.num_fewshot, self.include_path, self.batch_size = num_fewshot, include_path, batch_size
        self._task_set: Any = None
        self._last_step = -1

    @property
    def enabled(self) -> bool:
        return bool(self.tasks and self.every_n_steps)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self.load_tasks()

    def load_tasks(self) -> None:
        """Find the tasks (once): an unknown task is one error line. The CLI calls it before the fit starts, so
        that a refusal leaves no run directory behind."""
        if not self.enabled or self._task_set is not None:
            return
        require_harness("eval.tasks")
        from training.eval.tasks import TaskSet

        self._task_set = TaskSet.load(self.tasks, self.num_fewshot, self.limit, self.include_path,
                                      loglikelihood_only=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if not self.enabled or step == self._last_step or step == 0:  # once per update, after it
            return
        self._last_step = step
        stop = signals.active()
        if stop is not None and stop.stopped is not None:
            # A stop signal: the step is saved and the run resumes later; the harness would spend the time a
            # cluster's warning leaves before the job is killed (the same decision on every rank).
            return
        if step % self.every_n_steps == 0 or 0 < trainer.max_steps <= step:
            self.evaluate(trainer, pl_module, step)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule, step: int) -> dict[str, dict[str, float]]:
        """Score the tasks now on every rank; rank 0 records them. Returns the per-task metrics."""
        from training.eval import tasks
        from training.eval.harness import NormlabLM

        start = time.perf_counter()
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            lm = NormlabLM(model, trainer.datamodule.tokenizer_path, self.batch_size, str(pl_module.device),
                           distributed=trainer.world_size > 1)
            # The harness's progress bars are not the training console's (normlab logs the result below).
            with torch.no_grad(), trainer.precision_plugin.forward_context(), contextlib.redirect_stderr(io.StringIO()):
                results = tasks.score(lm, self._task_set)
        finally:
            model.train(was_training)
        metrics = tasks.task_metrics(results, self._task_set)
        seconds = time.perf_counter() - start
        if trainer.is_global_zero:
            run_dir = Path(trainer.default_root_dir)
            tasks.record(tasks.result_path(run_dir, step), step, metrics, results, self._task_set.settings(), None,
                         run_dir, partial(log_scalars, trainer))
            log_scalars(trainer, {"eval/seconds": seconds}, step)
            log.info("step %d, downstream (%.1f s): %s", step, seconds, tasks.summary_line(metrics))
        return metrics

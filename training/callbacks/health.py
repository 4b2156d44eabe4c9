"""Training-health metrics in TensorBoard: residual growth, softmax saturation, gradient flow.

Every `every_n_steps` optimizer steps, at step 0 (an init audit) and on the run's last update (the state it ends
in, which a multiple of `every_n_steps` rarely is), the first micro-batch of the step runs
with the probes' forward hooks attached (`model.probes.record`: residual-stream RMS and update ratios per layer,
softmax statistics from sampled query rows; the training forward itself is unchanged), and after its backward
the per-layer gradient norms are read — correctly under
ZeRO 1/2/3, where `p.grad` is partitioned or None, through DeepSpeed's `safe_get_full_grad` (called by every
rank in the same order: it is a collective). On other steps nothing is attached and nothing runs.

The values are rank 0's (its micro-batch; gradients are already reduced over ranks) and go straight to the
TensorBoard writer, with a custom-scalar layout that puts all layers of a metric in one chart (only the charts the
run can fill; `layout`).

The same steps log stability telemetry (training/callbacks/stability.py, its own dashboard): each layer's exact
max attention logit over the probed micro-batch, and ‖update‖/‖param‖ of the step's optimizer update per block for
the attention, MLP and norm-gain parameters (read after the optimizer step, on_train_batch_end).

The same steps log outlier and sink telemetry (`outlier/*`, `attn/sink_mass*`: from the probes; `norm/gain_*`:
the norm gains, gathered under ZeRO like the parameter norms) and, to TensorBoard's Images tab, a depth-profile
figure (`profile/depth`, training/callbacks/depth_profile.py) of this step beside step 0. Step 0's profile is
kept in memory and in the checkpoint (this callback's state), so a resumed run still draws it; a run resumed
from a checkpoint written without it draws the current step only and says so in the figure's title.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from model.names import split_layer
from model.probes import gain_stats, gain_tags, grad_norms, record
from training import health_tags as T
from training.callbacks import depth_profile
from training.callbacks.guard import NonFiniteGuard
from training.callbacks.stability import StabilityProbe, update_groups
from training.distributed import full_grad, full_param, is_deepspeed
from training.health_tags import layer_pattern
from training.loggers import log_scalars, tensorboard

log = logging.getLogger(__name__)

# Chart title → (regex over tags); each chart shows every layer of one metric (training/health_tags.py).
LAYOUT = {
    "Residual growth": {
        "stream RMS entering block": layer_pattern(T.RESID_RMS),
        "attention update / stream": layer_pattern(f"{T.UPDATE_RATIO}/attn"),
        "MLP update / stream": layer_pattern(f"{T.UPDATE_RATIO}/mlp"),
        "attention reads (RMS after norm)": layer_pattern(f"{T.READ_RMS}/attn"),
        "final-norm input RMS": T.FINAL_IN,
    },
    "Softmax saturation": {
        "max attention probability (mean over heads)": layer_pattern(T.ATTN_MAX_PROB),
        "normalized entropy": layer_pattern(T.ATTN_ENTROPY),
        "saturated fraction": layer_pattern(T.ATTN_SATURATED),
        "max pre-softmax logit": layer_pattern(T.ATTN_MAX_LOGIT),
        "max logit, worst head": layer_pattern(T.ATTN_MAX_LOGIT + T.WORST),
    },
    "Gradient flow": {
        "gradient norm per block": layer_pattern(T.GRAD_NORM),
        "global gradient norm": T.GRAD_GLOBAL,
        "parameter norm per block": layer_pattern(T.PARAM_NORM),
        "QK-norm gains (mean)": rf"{T.QK_GAIN}/(q|k)/mean/L\d+",
        "skipped steps (guard)": r"guard/skipped_steps",
    },
    "Outliers": {
        "stream max |x| / RMS (massive activations)": rf"{T.MAX_OVER_RMS}/(L\d+|final_in)",
        "stream excess kurtosis (per token, over features)": rf"{T.KURTOSIS}/(L\d+|final_in)",
        "attention sink: probability on key 0 (mean over heads)": layer_pattern(T.SINK_MASS),
        "sink mass, largest head": layer_pattern(T.SINK_MASS + T.WORST),
        "explicit sink's share (attn_sink)": layer_pattern(T.SINK_LOGIT_MASS),
        "attention output gate, mean σ (attn_gate)": layer_pattern(T.GATE_MEAN),
        "norm gains: mean |γ|": rf"{T.GAIN_MEAN}/.+",
        "norm gains: max |γ|": rf"{T.GAIN_MAX}/.+",
    },
    "Stability": {  # callbacks/stability.py; QK-clip's per-step values when optim.qk_clip is set
        "exact max logit per layer, largest head": layer_pattern(T.ATTN_MAX_LOGIT_EXACT + T.WORST),
        "exact max logit per layer, mean over heads": layer_pattern(T.ATTN_MAX_LOGIT_EXACT),
        "attention ‖update‖/‖param‖ per block": layer_pattern(f"{T.UPDATE_PARAM_RATIO}/attn"),
        "MLP ‖update‖/‖param‖ per block": layer_pattern(f"{T.UPDATE_PARAM_RATIO}/mlp"),
        "norm gains ‖update‖/‖param‖ per block": layer_pattern(f"{T.UPDATE_PARAM_RATIO}/norm"),
        "QK-clip: largest logit and heads clipped, every step": rf"{T.QK_CLIP_MAX_LOGIT}|{T.QK_CLIP_HEADS}",
    },
}
QK_GAIN_PARAMS = ("attn.q_norm.weight", "attn.k_norm.weight")  # a block's QK-norm gains (`qk_gain/{q,k}/*`)


@dataclass(frozen=True)
class RunCharts:
    """What decides which charts of LAYOUT a run can fill: its model (the parameters it has write the gain tags,
    its config the sink and gate tags) and the run-level series of other callbacks."""

    model: torch.nn.Module
    qk_clip: bool = False  # optim.qk_clip is set: its per-step series
    skips: bool = False  # a step can be skipped: guard.policy skip, or DeepSpeed's own overflow skips


def _norm_gains(run: RunCharts) -> bool:
    return bool(gain_tags(run.model))


# Charts whose tags only some runs write, with what makes them: other runs leave them out (an empty panel says
# nothing). A run with no norm gains (`norm: none`; an l2 QK-norm's temperature is no gain) has no gain charts.
NEEDS: dict[str, Callable[[RunCharts], bool]] = {
    "explicit sink's share (attn_sink)": lambda run: run.model.cfg.attn_sink != "none",
    "attention output gate, mean σ (attn_gate)": lambda run: run.model.cfg.attn_gate != "none",
    "QK-norm gains (mean)": lambda run: any((block := split_layer(name)) is not None and block[2] in QK_GAIN_PARAMS
                                            for name, _ in run.model.named_parameters()),
    "norm gains: mean |γ|": _norm_gains,
    "norm gains: max |γ|": _norm_gains,
    "norm gains ‖update‖/‖param‖ per block": lambda run: "norm" in {
        tag.split("/")[-2] for tag in update_groups(run.model).values()},
    "QK-clip: largest logit and heads clipped, every step": lambda run: run.qk_clip,
    "skipped steps (guard)": lambda run: run.skips,
}
# Charts a run may fill but that stay empty until something happens: the title says so.
UNTIL = {"skipped steps (guard)": "empty until a step is skipped"}
PER_LAYER = re.compile(re.escape(r"L\d+"))  # a chart with one series per layer
PROFILE_TAG = "profile/depth"  # the depth-profile image


def chart_title(title: str, regex: str, n_layers: int) -> str:
    """The title TensorBoard shows: a per-layer chart names its layers and where its legend is. The custom-scalar
    chart colours a series by its run and marks each tag with a marker shape (◼ ◆ ▲ ★ ✚, in turn); which marker
    is which layer is listed under the chart's collapsed "Matches" (a layout cannot colour or open it)."""
    if title in UNTIL:
        return f"{title}: {UNTIL[title]}"
    if PER_LAYER.search(regex):
        final = ", final_in" if "final_in" in regex else ""
        return f"{title} · L0–L{n_layers - 1}{final} (markers: see Matches)"
    if regex.endswith("/.+"):  # every norm's gain: a series per norm of every block, and the final norm
        return f"{title} · every norm (markers: see Matches)"
    return title


def layout(run: RunCharts) -> dict[str, dict[str, str]]:
    """LAYOUT for `run` (chart title → tag regex, by category): the charts of NEEDS only where the run writes
    their tags, titled by `chart_title`."""
    n_layers = run.model.cfg.n_layers
    return {category: {chart_title(title, regex, n_layers): regex for title, regex in charts.items()
                       if title not in NEEDS or NEEDS[title](run)}
            for category, charts in LAYOUT.items()}


def run_charts(trainer: Trainer, pl_module: LightningModule) -> RunCharts:
    """The RunCharts of a fit: its model, whether QK-clip runs, whether a step can be skipped."""
    skips = is_deepspeed(trainer.strategy) or any(isinstance(c, NonFiniteGuard) and c.policy == "skip"
                                                  for c in trainer.callbacks)
    return RunCharts(pl_module.model, qk_clip=getattr(pl_module.optim, "qk_clip", None) is not None, skips=skips)


class TrainingHealth(Callback):
    def __init__(self, every_n_steps: int = 50, histogram_every_n_steps: int = 500, attn_rows: int = 64,
                 saturation_threshold: float = 0.99) -> None:
        if every_n_steps < 0 or histogram_every_n_steps < 0:
            raise ValueError("metrics every_n_steps and histogram_every_n_steps must be >= 0 (0 disables)")
        self.every_n_steps, self.histogram_every_n_steps = every_n_steps, histogram_every_n_steps
        self.attn_rows, self.threshold = attn_rows, saturation_threshold
        self._probe = None  # the active `record(...)` context on a metrics step
        self._values: dict[str, float] = {}
        self._profile0: dict[str, float] | None = None  # step 0's depth profile (kept in the checkpoint)
        self._stability = StabilityProbe()  # exact max logits and update ratios (callbacks/stability.py)
        self._update_step: int | None = None  # the metrics step whose update ratios on_train_batch_end logs

    def state_dict(self) -> dict[str, Any]:
        return {"profile0": dict(self._profile0)} if self._profile0 is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._profile0 = state_dict.get("profile0")

    def _due(self, step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def _metrics_step(self, trainer: Trainer, step: int) -> bool:
        """Whether update `step` (0-based) is probed: every `every_n_steps`, and the last of `max_steps`."""
        last = trainer.max_steps is not None and step == trainer.max_steps - 1
        return self.every_n_steps > 0 and (step % self.every_n_steps == 0 or last)

    # -- layout ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        writer = self._writer(trainer)
        if writer is not None and self.every_n_steps:
            writer.add_custom_scalars({chart: {title: ["Multiline", [regex]] for title, regex in charts.items()}
                                       for chart, charts in layout(run_charts(trainer, pl_module)).items()})

    # -- probes around the first micro-batch of a metrics step ---------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        first_micro = batch_idx % trainer.accumulate_grad_batches == 0
        if first_micro and self._metrics_step(trainer, trainer.global_step):
            self._probe = record(pl_module.model, attn_rows=self.attn_rows, saturation_threshold=self.threshold)
            self._values = {}
            self._recorder = self._probe.__enter__()
            self._stability.start(pl_module.model)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._probe is not None:  # the forward is done: detach before backward (and before any recompute)
            self._probe.__exit__(None, None, None)
            self._probe = None
            exact = self._stability.logits()
            self._values.update(self._recorder.scalars())
            if exact:
                self._values.update(dict(zip(exact, torch.stack(list(exact.values())).tolist(), strict=True)))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        if not self._metrics_step(trainer, step):
            return
        model, deepspeed = pl_module.model, is_deepspeed(trainer.strategy)
        # DeepSpeed accumulates gradients itself, so Lightning calls this every micro-batch; the reduced
        # gradients exist only at the accumulation boundary.
        if deepspeed and not trainer.strategy.deepspeed_engine.is_gradient_accumulation_boundary():
            return
        self._values.update(grad_norms(model, partial(full_grad, deepspeed=deepspeed)))
        self._values.update(self._param_stats(model, deepspeed))
        self._stability.before_step(model, deepspeed)
        self._update_step = step
        log_scalars(trainer, self._values, step)
        if step == 0:
            self._profile0 = depth_profile.profile_values(self._values)
        self._log_profile(trainer, step)
        if self._due(step, self.histogram_every_n_steps):
            self._histograms(trainer, model, deepspeed, step)
        self._values = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """After a metrics step's optimizer step: its ‖update‖/‖param‖ per block and group."""
        if self._update_step is not None:
            step, self._update_step = self._update_step, None
            log_scalars(trainer, self._stability.after_step(pl_module.model, is_deepspeed(trainer.strategy)), step)

    def _param_stats(self, model: torch.nn.Module, deepspeed: bool) -> dict[str, float]:
        """Per-block parameter norms, QK-norm gain statistics and every norm's `norm/gain_*` (gathered under ZeRO)."""
        sq: dict[str, torch.Tensor] = {}
        out: dict[str, float] = {}
        gains = gain_tags(model)
        for name, p in model.named_parameters():
            full = full_param(p, deepspeed).float()
            if name in gains:
                out.update(gain_stats(full, *gains[name]))
            block = split_layer(name)
            if block:
                _, index, rest = block
                key = T.layer(T.PARAM_NORM, index)
                sq[key] = sq.get(key, 0) + full.pow(2).sum()
                if rest in QK_GAIN_PARAMS:
                    qk = f"{T.QK_GAIN}/{rest.removeprefix('attn.')[0]}"  # q or k
                    out.update({T.layer(qk, index, "mean"): full.mean().item(),
                                T.layer(qk, index, "max"): full.max().item(),
                                T.layer(qk, index, "min"): full.min().item()})
        out.update({k: v.sqrt().item() for k, v in sq.items()})
        return out

    def _log_profile(self, trainer: Trainer, step: int) -> None:
        """The depth-profile image of this metrics step (rank 0, TensorBoard only)."""
        writer = self._writer(trainer)
        if writer is None:
            return
        values = depth_profile.profile_values(self._values)
        if not values:
            return
        image = depth_profile.render(values, step, self._profile0, initial_note="step 0 not in the checkpoint")
        writer.add_image(PROFILE_TAG, image, step, dataformats="HWC")

    def _histograms(self, trainer: Trainer, model: torch.nn.Module, deepspeed: bool, step: int) -> None:
        writer = self._writer(trainer)
        for name, p in model.named_parameters():
            if "norm" in name:  # gains: where normalization's learned scale goes
                full = full_param(p, deepspeed)
                if writer is not None:
                    writer.add_histogram(f"hist/{name}", full.float().cpu(), step)

    @staticmethod
    def _writer(trainer: Trainer) -> Any:
        return tensorboard(trainer)  # the charts, images and histograms are TensorBoard's alone

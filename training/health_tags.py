"""The training-health tags: the only place normlab's readers spell them, as eval/metrics.py is for held-out tags.

model/probes.py writes them (the recorder's per-layer statistics, `grad_norms`, `gain_stats`; model/ cannot import
training/, so tests/test_health_tags.py checks that every tag it writes is one of these families); the health
callback adds the parameter statistics. Readers — the health callback's charts and depth profile, `normlab
compare`, the coordinate check, the study — build and match tags here. A per-layer tag is `<family>/L<layer>`,
with the sublayer (`attn`, `mlp`) before the layer where the family has one: `resid/update_ratio/attn/L3`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

SUBLAYERS = ("attn", "mlp")

# the residual stream (RMS values: means over tokens of each token's RMS)
RESIDUAL = "resid/"  # every family of the stream
RESID_RMS = "resid/rms"  # the stream entering block l
RESID_RMS_OUT = "resid/rms_out"  # the stream leaving block l
UPDATE_RMS = "resid/update_rms"  # /<sublayer>: what the sublayer adds to the stream
UPDATE_RATIO = "resid/update_ratio"  # /<sublayer>: update RMS / stream RMS
READ_RMS = "resid/read_rms"  # /<sublayer>: what the sublayer reads, after its norm if any
FINAL_IN = "resid/final_in"  # the final norm's input (no layer)
# attention (mean over heads; `<family>_worst` the worst head)
ATTN_MAX_PROB = "attn/max_prob"
ATTN_ENTROPY = "attn/entropy"
ATTN_SATURATED = "attn/saturated_frac"
ATTN_MAX_LOGIT = "attn/max_logit"
SINK_MASS = "attn/sink_mass"  # the probability on key 0
SINK_LOGIT_MASS = "attn/sink_logit_mass"  # the explicit sink's share (model.attn_sink), 1 − Σ p over the keys
GATE_MEAN = "attn/gate_mean"  # the mean output-gate value σ(x W_g) (model.attn_gate)
WORST = "_worst"
# outliers of the stream entering block l (`<family>/final_in`: the final norm's input)
OUTLIER = "outlier/"  # every outlier family
MAX_OVER_RMS = "outlier/max_over_rms"
KURTOSIS = "outlier/kurtosis"
# parameters and gradients
GAIN_MEAN = "norm/gain_mean"  # /<role>/L<l> or /final
GAIN_MAX = "norm/gain_max"
GRAD_NORM = "grad/norm"
GRAD_GLOBAL = "grad/global"
PARAM_NORM = "param/norm"
QK_GAIN = "qk_gain"  # /<q|k>/<mean|max|min>/L<l>

# every family that has one tag per layer (what model/probes.py and the health callback write)
LAYER_FAMILIES = (RESID_RMS, RESID_RMS_OUT, *(f"{f}/{s}" for f in (UPDATE_RMS, UPDATE_RATIO, READ_RMS)
                                             for s in SUBLAYERS),
                  *(f + w for f in (ATTN_MAX_PROB, ATTN_ENTROPY, ATTN_SATURATED, ATTN_MAX_LOGIT, SINK_MASS,
                                    SINK_LOGIT_MASS) for w in ("", WORST)), GATE_MEAN,
                  MAX_OVER_RMS, KURTOSIS, GRAD_NORM, PARAM_NORM)

# stability telemetry (training/callbacks/stability.py): the exact max pre-softmax logit of each layer over the
# probed batch (mean over heads; `_worst` the largest head), and ‖update‖/‖param‖ of the optimizer step per block
# and parameter group (attn, mlp, norm); QK-clip's per-step values (no layer)
ATTN_MAX_LOGIT_EXACT = "attn/max_logit_exact"
UPDATE_PARAM_RATIO = "optim/update_ratio"
UPDATE_GROUPS = ("attn", "mlp", "norm")
QK_CLIP_MAX_LOGIT = "qk_clip/max_logit"  # the largest logit of the step's forward, every layer and head
QK_CLIP_HEADS = "qk_clip/heads_clipped"  # the heads whose query and key rows the step scaled
STABILITY_FAMILIES = (ATTN_MAX_LOGIT_EXACT, ATTN_MAX_LOGIT_EXACT + WORST,
                      *(f"{UPDATE_PARAM_RATIO}/{g}" for g in UPDATE_GROUPS))
LAYER_FAMILIES = (*LAYER_FAMILIES, *STABILITY_FAMILIES)


def layer(family: str, index: int | str, sublayer: str | None = None) -> str:
    """The tag of `family` at block `index` (`sublayer`: attn or mlp, for the families that have one)."""
    return f"{family}/{sublayer}/L{index}" if sublayer else f"{family}/L{index}"


def layer_pattern(family: str) -> str:
    """A regex matching `family`'s tag at any block (for TensorBoard's custom-scalar charts)."""
    return rf"{re.escape(family)}/L\d+"


def by_layer(tags: Iterable[str], family: str) -> list[tuple[int, str]]:
    """(layer, tag) of every tag of `family` among `tags`, in layer order."""
    found = (re.fullmatch(rf"{re.escape(family)}/L(\d+)", tag) for tag in tags)
    return sorted((int(m.group(1)), m.group(0)) for m in found if m)

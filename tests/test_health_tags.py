"""The training-health tags have one owner (training/health_tags.py): every tag the probes and the health callback
write is one of its families, each family is written, and no reader in training/ spells a tag itself."""
from __future__ import annotations

import ast
import re

import pytest
import torch

from model import ModelConfig, Transformer
from model.probes import gain_stats, gain_tags, grad_norms, record
from tests.helpers.multiproc import REPO
from training import health_tags as T
from training.callbacks.health import LAYOUT, RunCharts, TrainingHealth, layout
from training.callbacks.stability import StabilityProbe

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def written_tags(model: Transformer | None = None) -> set[str]:
    """Every tag a metrics step writes for `model` (by default a tiny QK-normed model with a learnable sink and an
    output gate): the recorder's, the gradient norms, the norm gains', the health callback's parameter statistics
    and the stability telemetry (exact max logits, update ratios)."""
    if model is None:
        model = Transformer(ModelConfig.preset("qwen3", **TINY, attn_sink="learnable", attn_gate="head"))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    stability = StabilityProbe()
    stability.start(model)
    with record(model) as rec:
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    stability.before_step(model, deepspeed=False)
    tags = set(rec.scalars()) | set(grad_norms(model)) | set(stability.logits())
    tags |= set(stability.after_step(model, deepspeed=False))
    for name, p in model.named_parameters():
        if name in gain_tags(model):
            tags |= set(gain_stats(p.detach(), *gain_tags(model)[name]))
    return tags | set(TrainingHealth()._param_stats(model, deepspeed=False))


def test_every_written_tag_is_a_family_of_the_vocabulary_and_every_family_is_written():
    layer = "|".join(re.escape(f) for f in T.LAYER_FAMILIES)
    once = [T.FINAL_IN, T.GRAD_GLOBAL, *(f"{f}/final_in" for f in (T.MAX_OVER_RMS, T.KURTOSIS))]
    patterns = [rf"({layer})/L\d+", *map(re.escape, once), rf"{T.GRAD_NORM}/\w+",
                rf"({T.GAIN_MEAN}|{T.GAIN_MAX})/(\w+/L\d+|final)", rf"{T.QK_GAIN}/(q|k)/(mean|max|min)/L\d+"]
    tags = written_tags()
    assert [t for t in tags if not any(re.fullmatch(p, t) for p in patterns)] == []
    assert [f for f in T.LAYER_FAMILIES if not T.by_layer(tags, f)] == []


def _spelled(path) -> list[str]:
    """The string constants of a module that spell a health tag (docstrings and comments aside)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    prefixes = ("resid/", "attn/", "outlier/", "norm/gain", "grad/norm", "grad/global", "param/norm", "qk_gain/")
    return [f"{path.relative_to(REPO)}:{n.lineno}: {n.value}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and any(p in n.value for p in prefixes)]


def test_no_reader_spells_a_health_tag():
    spelled = [s for p in sorted((REPO / "training").rglob("*.py")) if p.name != "health_tags.py"
               for s in _spelled(p)]
    assert spelled == []


@pytest.mark.parametrize("preset, fields", [("llama", {}), ("qwen3", {}), ("qwen3", {"qk_norm_kind": "l2"}),
                                            ("llama", {"norm": "none"}), ("qwen3", {"attn_sink": "learnable"})])
def test_the_layout_holds_exactly_the_charts_the_model_fills(preset, fields):
    """A chart of the dashboards is in a run's layout iff the run writes a tag it matches: without QK-norm (or with
    an l2 QK-norm, which has no gain) no QK-norm-gain chart, without norms no gain charts; the guard's and
    QK-clip's charts only where those can log."""
    model = Transformer(ModelConfig.preset(preset, **TINY, **fields))
    tags = written_tags(model)
    charts = {regex: title for category in layout(RunCharts(model)).values() for title, regex in category.items()}
    every = {regex for category in LAYOUT.values() for regex in category.values()}
    filled = {regex for regex in every if any(re.fullmatch(regex, tag) for tag in tags)}
    assert set(charts) == filled
    assert (rf"{T.QK_GAIN}/(q|k)/mean/L\d+" in charts) == (preset == "qwen3" and not fields.get("qk_norm_kind"))
    run_level = layout(RunCharts(model, qk_clip=True, skips=True))
    added = {t for category in run_level.values() for t in category} - set(charts.values())
    assert added == {"skipped steps (guard): empty until a step is skipped",
                     "QK-clip: largest logit and heads clipped, every step"}


def test_per_layer_charts_name_their_layers():
    """TensorBoard colours a custom-scalar series by run and tells layers apart by marker only, listed under the
    chart's "Matches": a per-layer chart's title names the layers and points there."""
    charts = layout(RunCharts(Transformer(ModelConfig(**{**TINY, "n_layers": 3}))))
    assert charts["Gradient flow"]["gradient norm per block · L0–L2 (markers: see Matches)"] == rf"{T.GRAD_NORM}/L\d+"
    assert charts["Gradient flow"]["global gradient norm"] == T.GRAD_GLOBAL
    assert "stream max |x| / RMS (massive activations) · L0–L2, final_in (markers: see Matches)" in charts["Outliers"]

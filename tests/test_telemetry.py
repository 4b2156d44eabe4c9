"""Outlier and sink telemetry (model/probes.py) checked against independent float64 computations, and the
depth-profile figure (training/callbacks/depth_profile.py)."""
from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

from model import ModelConfig, Transformer
from model.norms import NORMS
from model.probes import gain_tags, norm_gains, record, sink_mass, stream_outliers
from model.rope import rope_cos_sin
from tests.test_model_structure import FORMULAS
from training import health_tags as T
from training.callbacks import depth_profile


def outliers_reference(x: torch.Tensor) -> dict[str, float]:
    """max |x| / RMS over all entries and the mean over tokens of each token's excess kurtosis (fourth central
    moment over the squared biased variance, minus 3), in float64 numpy."""
    a = x.detach().double().reshape(-1, x.shape[-1]).numpy()
    m4 = ((a - a.mean(-1, keepdims=True)) ** 4).mean(-1)
    return {"max_over_rms": np.abs(a).max() / np.sqrt((a**2).mean()),
            "kurtosis": (m4 / np.var(a, axis=-1) ** 2 - 3).mean()}


def sink_reference(q: torch.Tensor, k: torch.Tensor, rows: list[int], softcap: float | None = None,
                   doc_ids: torch.Tensor | None = None) -> np.ndarray:
    """Per-head probability on the sink, mean over batch and `rows`, by explicit float64 softmax loops: key 0 of
    the causal keys, or with `doc_ids` the first key of the row's own document among that document's keys (rows
    that see only their sink left out)."""
    q, k = q.detach().double().numpy(), k.detach().double().numpy()
    B, H, T, D = q.shape
    docs = np.zeros((B, T), dtype=int) if doc_ids is None else doc_ids.numpy()
    group = H // k.shape[1]
    out = np.zeros(H)
    for h in range(H):
        acc = []
        for b in range(B):
            for r in rows:
                keys = [j for j in range(r + 1) if docs[b, j] == docs[b, r]]
                if len(keys) < 2:
                    continue
                s = np.array([q[b, h, r] @ k[b, h // group, j] / math.sqrt(D) for j in keys])
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                e = np.exp(s - s.max())
                acc.append(e[0] / e.sum())
        out[h] = np.mean(acc)
    return out


def test_stream_outliers_find_a_planted_outlier():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    clean = stream_outliers(x)
    want = outliers_reference(x)
    assert clean["kurtosis"].item() == pytest.approx(want["kurtosis"], rel=1e-4, abs=1e-5)
    assert abs(clean["kurtosis"].item()) < 0.5  # Gaussian features: excess kurtosis near 0
    x[1, 5, 7] = 300.0  # a massive activation in one token and feature
    x[:, :, 3] *= 8.0  # an outlier feature in every token
    got, want = stream_outliers(x), outliers_reference(x)
    for key in ("max_over_rms", "kurtosis"):
        assert got[key].item() == pytest.approx(want[key], rel=1e-4), key
    assert got["max_over_rms"].item() > 30 and got["kurtosis"].item() > 10


def test_sink_mass_matches_a_float64_softmax_with_gqa_and_softcap():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8) * 2, torch.randn(2, 2, 9, 8) * 2
    rows = [2, 5, 8]
    for cap in (None, 1.5):
        got = sink_mass(q, k, torch.tensor([0, *rows]), 8 ** -0.5, softcap=cap)  # row 0 is left out
        np.testing.assert_allclose(got.numpy(), sink_reference(q, k, rows, cap), rtol=1e-5)
    with pytest.raises(ValueError, match="past position 0"):
        sink_mass(q, k, torch.tensor([0]), 8 ** -0.5)


def test_sink_mass_under_a_document_mask_is_each_documents_first_token():
    """Documents [0..2], [3..6], [7..8] in row 0 and one document in row 1: a row sees its own document, its sink
    is that document's first token, and a document's first token (row 3, 7) is left out."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 9, 8) * 2, torch.randn(2, 2, 9, 8) * 2
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0] * 9])
    rows = [2, 3, 5, 7, 8]
    for cap in (None, 1.5):
        got = sink_mass(q, k, torch.tensor(rows), 8 ** -0.5, softcap=cap, doc_ids=doc_ids)
        np.testing.assert_allclose(got.numpy(), sink_reference(q, k, rows, cap, doc_ids), rtol=1e-5)
    with pytest.raises(ValueError, match="besides its sink"):
        sink_mass(q, k, torch.tensor([3, 7]), 8 ** -0.5, doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * 2))


def test_sink_mass_is_one_when_attention_is_forced_onto_key_0():
    T, D = 8, 4
    q = torch.zeros(1, 2, T, D)
    q[..., 0] = 50.0
    k = torch.zeros(1, 1, T, D)
    k[0, 0, 0, 0] = 10.0  # only key 0 answers q: logit 250 against 0 everywhere else
    assert torch.allclose(sink_mass(q, k, torch.arange(T), 1 / math.sqrt(D)), torch.ones(2))
    uniform = sink_mass(torch.zeros(1, 1, T, D), k, torch.arange(T), 0.5)  # all logits equal: 1/(r+1) on key 0
    assert uniform.item() == pytest.approx(np.mean([1 / (r + 1) for r in range(1, T)]), rel=1e-6)


def forward_reference(model: Transformer, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple]]:
    """A hand-written float64 forward (each placement's formula from test_model_structure): the stream entering
    each block and the final norm's input, and each layer's post-RoPE (q, k) taken from the float64 RoPE."""
    ref = copy.deepcopy(model).double()
    cos, sin = rope_cos_sin(tokens.shape[1], ref.cfg.head_dim, ref.cfg.rope_theta)
    streams, qk = [], []
    x = ref.tok_embeddings(tokens)
    for layer in ref.layers:
        streams.append(x)
        handle = layer.attn.rope.register_forward_hook(lambda m, args, out: qk.append(out))
        formula = FORMULAS.get(ref.cfg.placement, lambda p, x, f: p.formula(x, f))
        x = formula(layer.attn_res, x, lambda h, layer=layer: layer.attn(h, cos, sin))
        x = formula(layer.mlp_res, x, layer.mlp)
        handle.remove()
    return [*streams, x], qk


@pytest.mark.parametrize("placement,norm", [("pre", "rmsnorm"), ("post", "layernorm"), ("sandwich", "dyt"),
                                            ("pre", "none")])
def test_outlier_and_sink_tags_match_a_float64_forward(placement, norm):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, placement=placement,
                                    norm=norm, qk_norm="head" if norm != "none" else "none",
                                    init_std=0.02 if norm != "none" else 0.3))
    with torch.no_grad():
        model.tok_embeddings.weight[5, 3] = 4.0  # a planted outlier: token 5's feature 3
    tokens = torch.randint(0, 64, (2, 12))
    tokens[:, 4] = 5
    with record(model, attn_rows=64, attn_batch=1) as rec:
        model(tokens)
    got = rec.scalars()
    streams, qk = forward_reference(model, tokens)
    for where, x in zip([f"L{l}" for l in range(3)] + ["final_in"], streams, strict=True):
        want = outliers_reference(x)
        for key in ("max_over_rms", "kurtosis"):
            assert got[f"outlier/{key}/{where}"] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (key, where)
    assert got["outlier/max_over_rms/L0"] > 10  # the planted outlier shows in the stream entering block 0
    for l, (q, k) in enumerate(qk):
        per_head = sink_reference(q[:1], k[:1], list(range(1, 12)))  # the recorder reads batch row 0, all rows
        assert got[f"attn/sink_mass/L{l}"] == pytest.approx(per_head.mean(), rel=1e-5)
        assert got[f"attn/sink_mass_worst/L{l}"] == pytest.approx(per_head.max(), rel=1e-5)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_gains_after_setting_known_values(norm):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=8, n_layers=2, n_heads=2, placement="sandwich", qk_norm="head", norm=norm)
    model = Transformer(cfg)
    gains = norm_gains(model)
    if norm == "none":
        assert gains == {} and gain_tags(model) == {}
        return
    known = {"layers.1.attn_res.norm_out.weight": ("attn_out/L1", [-3.0, 2.0, 0.5, 0.0, 1.0, 1.0, -0.25, 0.5]),
             "layers.0.attn.k_norm.weight": ("k/L0", [0.5, -4.0, 1.0, 2.0]),
             "norm.weight": ("final", [1.5] * 8)}
    params = dict(model.named_parameters())
    if params["norm.weight"].ndim == 0:  # one scalar gain per norm (rmsnorm_scalar)
        known = {name: (suffix, values[:1]) for name, (suffix, values) in known.items()}
    with torch.no_grad():
        for name, (_, values) in known.items():
            params[name].copy_(torch.tensor(values).reshape(params[name].shape))
    gains = norm_gains(model)
    # every norm of the model: 4 per block (sandwich) + QK-norm's q and k, and the final norm
    assert len(gains) == 2 * (2 * 6 + 1)
    for suffix, values in known.values():
        a = np.abs(np.array(values, dtype=np.float64))
        assert gains[f"norm/gain_mean/{suffix}"] == pytest.approx(a.mean(), rel=1e-7)
        assert gains[f"norm/gain_max/{suffix}"] == pytest.approx(a.max(), rel=1e-7)
    assert gains["norm/gain_mean/q/L1"] == gains["norm/gain_max/mlp_in/L0"] == 1.0  # untouched: γ = 1 at init


def test_offset_norm_gains_are_one_plus_the_stored_weight():
    model = Transformer(ModelConfig(vocab_size=64, dim=4, n_layers=1, n_heads=1, norm_offset=True))
    with torch.no_grad():
        model.layers[0].mlp_res.norm_in.weight.copy_(torch.tensor([0.0, -3.0, 1.0, -1.0]))
    gains = norm_gains(model)
    assert gains["norm/gain_mean/mlp_in/L0"] == pytest.approx((1 + 2 + 2 + 0) / 4)
    assert gains["norm/gain_max/mlp_in/L0"] == pytest.approx(2.0)
    assert gains["norm/gain_max/final"] == 1.0  # w = 0 stored, a gain of 1


def test_depth_profile_figure_draws_this_step_beside_step_0():
    values = {f"resid/rms/L{l}": 1.0 + l for l in range(4)} | {f"attn/sink_mass/L{l}": 0.1 * l for l in range(4)}
    values |= {f"resid/update_ratio/{s}/L{l}": 0.5 / (l + 1) for s in ("attn", "mlp") for l in range(4)}
    values |= {f"attn/max_logit/L{l}": 2.0 * l for l in range(4)}
    kept = depth_profile.profile_values({**values, "grad/norm/L0": 3.0, "attn/entropy/L0": 0.5})
    assert kept == values  # only what the figure draws
    initial = {k: v * 0.5 for k, v in values.items()}
    alone = depth_profile.render(values, 100, None)
    beside = depth_profile.render(values, 100, initial)
    assert alone.dtype == np.uint8 and alone.ndim == 3 and alone.shape[2] == 3 and alone.shape[:2] == beside.shape[:2]
    assert alone.shape[0] >= 150 and alone.shape[1] >= 600
    assert (alone != 255).any() and not np.array_equal(alone, beside)  # step 0's lines are drawn


def test_a_short_fit_logs_the_telemetry_the_outliers_layout_and_the_depth_profile(tmp_path):
    """A real Lightning fit with the TensorBoard logger: the new tags, the "Outliers" dashboard and one
    depth-profile image per metrics step — every 2 and the last (step 3 of 4) — are in the events; step 0's
    profile goes into the checkpoint."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from torch.utils.data import DataLoader

    from training.callbacks.health import PROFILE_TAG, TrainingHealth
    from training.lit_module import LitLM

    torch.manual_seed(0)
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=8, qk_norm="head")
    health = TrainingHealth(every_n_steps=2)
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=TensorBoardLogger(tmp_path, name="tb"),
                      log_every_n_steps=1, callbacks=[health], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, DataLoader(torch.randint(0, 64, (8, 9)), batch_size=2))
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {f"{stem}/L{l}" for l in range(2) for stem in ("outlier/max_over_rms", "outlier/kurtosis",
                                                          "attn/sink_mass", "attn/sink_mass_worst")}
    want |= {f"norm/gain_{s}/{role}/L{l}" for s in ("mean", "max") for role in ("attn_in", "mlp_in", "q", "k")
             for l in range(2)}
    want |= {"outlier/max_over_rms/final_in", "outlier/kurtosis/final_in", "norm/gain_mean/final"}
    assert want <= tags, sorted(want - tags)
    for tag in ("attn/sink_mass/L1", "grad/norm/L0", "optim/update_ratio/mlp/L1"):
        assert [e.step for e in acc.Scalars(tag)] == [0, 2, 3], tag
    images = acc.Images(PROFILE_TAG)
    assert [e.step for e in images] == [0, 2, 3] and images[0].width >= 600 and images[0].height >= 150
    saved = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [c.title for c in saved.category] == ["Residual growth", "Softmax saturation", "Gradient flow",
                                                 "Outliers", "Stability"]
    regexes = [chart.multiline.tag[0] for category in saved.category for chart in category.chart]
    assert [r for r in regexes if not any(re.fullmatch(r, t) for t in tags)] == []  # every chart has data
    assert rf"{T.QK_GAIN}/(q|k)/mean/L\d+" in regexes  # (this model has QK-norm gains)
    from training.callbacks.health import RunCharts, layout

    sunk = [*layout(RunCharts(Transformer(lit.config.replace(attn_sink="learnable", attn_gate="head"))))["Outliers"]]
    outliers = next(c for c in saved.category if c.title == "Outliers")
    assert len(sunk) == len(outliers.chart) + 2 and any(t.startswith("explicit sink's share") for t in sunk)

    trainer.save_checkpoint(tmp_path / "last.ckpt")
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]["TrainingHealth"]
    assert state["profile0"] == depth_profile.profile_values(
        {e: acc.Scalars(e)[0].value for e in tags if acc.Scalars(e)[0].step == 0}) != {}
    resumed = TrainingHealth(every_n_steps=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state

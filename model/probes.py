"""Training-health probes: residual-stream growth and softmax saturation, measured on demand.

Nothing here runs unless `record(model)` is active (`with record(model) as rec: model(tokens)`): it registers
forward hooks on every block, placement, sublayer and RoPE module of a `model.Transformer`, and removes them
on exit, so the hot path carries no probe code at all. The model runs its one (fused) forward; the hooks read
the stream entering and leaving each block and each sublayer, what the sublayer reads, and the post-RoPE q and
k, from which the softmax is recomputed for a few sampled query rows with the attention module's own scale
(`Attention.scale`: 1/√D, or μP's), softcap, sink logits and causal mask (and, under document masking, the same
document mask) — the main path keeps using `scaled_dot_product_attention`. What each statistic means under an
explicit sink (`attn_sink`) is in model/attention_stats.py.

Tags: `resid/rms/L{l}` (stream entering block l), `resid/rms_out/L{l}` (leaving it),
`resid/update_rms/{attn,mlp}/L{l}`, `resid/update_ratio/{attn,mlp}/L{l}` (update RMS / stream RMS: the block's
relative contribution), `resid/read_rms/{attn,mlp}/L{l}` (what the sublayer reads, after its norm if any),
`resid/final_in` (input to the final norm), and `attn/{max_prob,entropy,saturated_frac,max_logit}/L{l}` (mean
over heads) with `attn/*_worst/L{l}` (the worst head). With an explicit sink also `attn/sink_logit_mass/L{l}`
(the sink's share of the softmax, mean over heads; `_worst`: the largest head); with an output gate
(`attn_gate`) `attn/gate_mean/L{l}`, the mean gate value σ(x W_g) over tokens and heads (the quantity Qiu et al.
2025 analyse). RMS values are means over tokens of each token's RMS.

Outlier and sink telemetry (`stream_outliers`, `sink_mass`, `gain_stats`): `outlier/max_over_rms/L{l}` and
`outlier/kurtosis/L{l}` (the stream entering block l; `.../final_in` the final norm's input), `attn/sink_mass/L{l}`
(mean over heads; `attn/sink_mass_worst/L{l}` the largest head), and `norm/gain_mean/{role}/L{l}`,
`norm/gain_max/{role}/L{l}` (`role`: attn_in, attn_out, mlp_in, mlp_out, q, k, v, attn_sub, mlp_sub;
`norm/gain_*/final`) from the
parameters, outside the forward (`norm_gains`, or `gain_tags` + `gain_stats` where parameters are gathered).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from model.attention_stats import AttentionRows as AttentionRows  # re-exported: the probes' API
from model.attention_stats import attention_rows as attention_rows
from model.attention_stats import attention_stats, sink_mass
from model.names import layer_index, split_layer
from model.norms import Norm


def token_rms(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of each token's RMS over features (a 0-d fp32 tensor)."""
    return x.detach().float().pow(2).mean(-1).sqrt().mean()


def stream_outliers(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Outlier statistics of a residual stream x [..., D], as 0-d fp32 tensors.

    `max_over_rms`: the largest |x| over all entries over the RMS of all entries — the "massive activations" of
    Sun et al. 2024 are a few entries hundreds to thousands of times the typical size. `kurtosis`: the excess
    kurtosis of each token's D features, E[(x − μ)⁴] / σ⁴ − 3 with μ, σ² that token's mean and (biased) variance,
    averaged over tokens: 0 for Gaussian features, large when a few feature dimensions carry outliers. It is
    per token, so tokens of different scale do not by themselves make it large. A token with zero variance
    counts as 0.
    """
    x = x.detach().float().reshape(-1, x.shape[-1])  # [N, D]
    top = x.abs().amax()
    # Both statistics are scale-free: computed on x / max|x| and on standardized features, so an unnormalized
    # stream of size 1e10 (norm: none at a high learning rate) does not overflow fp32's fourth powers.
    max_over_rms = (x / top.clamp_min(1e-30)).pow(2).mean().rsqrt() if top > 0 else torch.zeros((), device=x.device)
    centred = x - x.mean(-1, keepdim=True)
    std = centred.pow(2).mean(-1, keepdim=True).sqrt()  # [N, 1]
    z4 = (centred / std.clamp_min(1e-30)).pow(4).mean(-1)
    kurt = torch.where(std.squeeze(-1) > 0, z4 - 3, 0.0)
    return {"max_over_rms": max_over_rms, "kurtosis": kurt.mean()}


def gain_tags(model: nn.Module) -> dict[str, tuple[str, bool]]:
    """{parameter name: (tag suffix, offset)} for the gain γ of every norm in a `model.Transformer`: suffix
    `{role}/L{l}` for a block's norm (`attn_in`, `attn_out`, `mlp_in`, `mlp_out`, QK-norm's `q`, `k`, `v`,
    Sub-LN's `attn_sub`, `mlp_sub`) or `final`;
    `offset` when the stored weight w means a gain of 1 + w (RMSNorm with `norm_offset`). `norm: none` has none."""
    out: dict[str, tuple[str, bool]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Norm) or not isinstance(getattr(module, "weight", None), nn.Parameter):
            continue
        parts = split_layer(name.replace("_orig_mod.", "") + ".")
        if parts is None:  # the final norm, or another outside the blocks (the embedding norm: `embed_norm`)
            bare = name.replace("_orig_mod.", "")
            suffix = "final" if bare == "norm" else bare.replace(".", "_")
        else:
            role = parts[2].rstrip(".").replace("_res.norm_", "_").replace(".sub_norm", "_sub")
            role = role.removeprefix("attn.").removesuffix("_norm")
            suffix = f"{role}/L{parts[1]}"
        out[f"{name}.weight"] = (suffix, bool(getattr(module, "offset", False)))
    return out


def gain_stats(weight: torch.Tensor, suffix: str, offset: bool = False) -> dict[str, float]:
    """`norm/gain_mean/{suffix}` and `norm/gain_max/{suffix}`: mean and max of |γ| over a norm's features, γ the
    effective gain (1 + w for an offset norm)."""
    gain = (weight.detach().float() + (1.0 if offset else 0.0)).abs()
    mean, top = torch.stack([gain.mean(), gain.amax()]).tolist()
    return {f"norm/gain_mean/{suffix}": mean, f"norm/gain_max/{suffix}": top}


def norm_gains(model: nn.Module) -> dict[str, float]:
    """`gain_stats` of every norm of a (not partitioned) `model.Transformer`."""
    tags, out = gain_tags(model), {}
    for name, p in model.named_parameters():
        if name in tags:
            out.update(gain_stats(p, *tags[name]))
    return out


class Recorder:
    """Collects probe values during one forward pass; `scalars()` turns them into {tag: float}."""

    def __init__(self, attn_rows: int = 64, saturation_threshold: float = 0.99, attn_batch: int = 1) -> None:
        self.attn_rows, self.threshold, self.attn_batch = attn_rows, saturation_threshold, attn_batch
        self.values: dict[str, torch.Tensor] = {}

    # -- residual stream --------------------------------------------------------------------------
    def block(self, layer: int, stream_in: torch.Tensor, stream_out: torch.Tensor) -> None:
        self.values[f"resid/rms/L{layer}"] = token_rms(stream_in)
        self.values[f"resid/rms_out/L{layer}"] = token_rms(stream_out)
        self.outliers(f"L{layer}", stream_in)

    def outliers(self, where: str, stream: torch.Tensor) -> None:
        for key, value in stream_outliers(stream).items():
            self.values[f"outlier/{key}/{where}"] = value

    def sublayer(self, layer: int, name: str, stream: torch.Tensor, read: torch.Tensor,
                 update: torch.Tensor) -> None:
        s, u = token_rms(stream), token_rms(update)
        self.values[f"resid/update_rms/{name}/L{layer}"] = u
        self.values[f"resid/update_ratio/{name}/L{layer}"] = u / s.clamp_min(1e-30)
        self.values[f"resid/read_rms/{name}/L{layer}"] = token_rms(read)

    def final(self, x: torch.Tensor) -> None:
        self.values["resid/final_in"] = token_rms(x)
        self.outliers("final_in", x)

    # -- attention ---------------------------------------------------------------------------------
    def attention(self, layer: int, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, scale: float,
                  softcap: float | None = None, doc_ids: torch.Tensor | None = None,
                  sink: torch.Tensor | None = None) -> None:
        """Softmax and sink statistics of layer `layer` from its post-RoPE q and k; `scale`, `softcap` and `sink`
        (sink logits [H]) are the attention module's own."""
        T = q_BHTD.shape[2]
        if T < 2:  # a single position attends only to itself: nothing to measure
            return
        rows = torch.linspace(0, T - 1, min(self.attn_rows, T), device=q_BHTD.device).round().long().unique()
        b = min(self.attn_batch, q_BHTD.shape[0])
        doc_ids = doc_ids[:b] if doc_ids is not None else None
        stats = attention_stats(q_BHTD[:b], k_BKTD[:b], rows, scale, self.threshold, softcap, doc_ids, sink)
        for key, per_head in stats.items():
            self.values[f"attn/{key}/L{layer}"] = per_head.mean()
            worst = per_head.amin() if key == "entropy" else per_head.amax()
            self.values[f"attn/{key}_worst/L{layer}"] = worst
        self.sink(layer, q_BHTD[:b], k_BKTD[:b], rows, scale, softcap, doc_ids, sink)

    def sink(self, layer: int, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, rows: torch.Tensor, scale: float,
             softcap: float | None = None, doc_ids: torch.Tensor | None = None,
             sink: torch.Tensor | None = None) -> None:
        per_head = sink_mass(q_BHTD, k_BKTD, rows, scale, softcap, doc_ids, sink)
        self.values[f"attn/sink_mass/L{layer}"] = per_head.mean()
        self.values[f"attn/sink_mass_worst/L{layer}"] = per_head.amax()

    def gate(self, layer: int, gate_logits: torch.Tensor) -> None:
        """`attn/gate_mean/L{l}`: the mean output-gate value σ(x W_g) over tokens and heads (channels)."""
        self.values[f"attn/gate_mean/L{layer}"] = torch.sigmoid(gate_logits.detach().float()).mean()

    def scalars(self) -> dict[str, float]:
        if not self.values:
            return {}
        keys = list(self.values)
        numbers = torch.stack([self.values[k].float() for k in keys]).tolist()  # one device sync
        return dict(zip(keys, numbers, strict=False))


@contextlib.contextmanager
def record(model: nn.Module, **kwargs) -> Iterator[Recorder]:
    """Observe a `model.Transformer`'s forward passes inside the `with` block; `kwargs` go to `Recorder`.

    Blocks compiled with `model.optimize.compile_blocks` run eagerly meanwhile (`torch.compiler.set_stance`):
    Dynamo does not guard on the hooks of submodules, so compiled code would silently skip hooks added after it
    was compiled.
    """
    rec = Recorder(**kwargs)
    handles = [h for i, block in enumerate(model.layers) for h in _observe_block(rec, i, block)]
    last = len(model.layers) - 1
    handles.append(model.layers[last].register_forward_hook(lambda m, args, out: rec.final(out.value())))
    try:
        with torch.compiler.set_stance("force_eager"):
            yield rec
    finally:
        for handle in handles:
            handle.remove()


def _observe_block(rec: Recorder, layer: int, block: nn.Module) -> list[RemovableHandle]:
    """Hooks reporting one block's stream, sublayer reads and updates, and post-RoPE q and k to `rec`.

    A block maps a `model.residual.Stream` to a `Stream`; `.value()` is the residual stream itself.
    """
    seen: dict[str, torch.Tensor] = {}
    handles = [
        block.register_forward_pre_hook(lambda m, args: seen.update(block_in=args[0].value())),
        block.register_forward_hook(lambda m, args, out: rec.block(layer, seen.pop("block_in"), out.value())),
        # the document mask attention runs with (None without document masking), for the softmax statistics
        block.attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.update(doc_mask=kwargs.get("doc_mask")), with_kwargs=True),
        # the softmax statistics use the attention module's own scale, softcap and sink logits
        block.attn.rope.register_forward_hook(
            lambda m, args, out: rec.attention(layer, *out, scale=block.attn.scale, softcap=block.attn.softcap,
                                               doc_ids=_doc_ids(seen.pop("doc_mask", None)),
                                               sink=None if block.attn.sink is None else block.attn.sink(out[0]))),
    ]
    if block.attn.gate_proj is not None:
        handles.append(block.attn.gate_proj.register_forward_hook(lambda m, args, out: rec.gate(layer, out)))
    for name, placement, sublayer in (("attn", block.attn_res, block.attn), ("mlp", block.mlp_res, block.mlp)):

        def after(m: nn.Module, args: tuple, out, name: str = name) -> None:
            stream, new = seen.pop("stream"), out.value()
            # What the sublayer adds to the (α-scaled) stream; under post-norm the sum is renormalized, so f(x) itself.
            update = new - m.skip(stream) if m.adds_to_stream else seen.pop("out")
            rec.sublayer(layer, name, stream=stream, read=seen.pop("read"), update=update)
            seen.pop("out", None)

        handles += [
            placement.register_forward_pre_hook(lambda m, args: seen.update(stream=args[0].value())),
            placement.register_forward_hook(after),
            sublayer.register_forward_pre_hook(lambda m, args: seen.update(read=args[0])),
            sublayer.register_forward_hook(lambda m, args, out: seen.update(out=out)),
        ]
    return handles


def _doc_ids(doc_mask) -> torch.Tensor | None:
    return None if doc_mask is None else doc_mask.doc_ids


def grad_norms(model: torch.nn.Module, grad_of=lambda p: p.grad) -> dict[str, float]:
    """L2 gradient norm per block (`grad/norm/L{l}`), of the embedding and head, and overall (`grad/global`).

    `grad_of(p)` returns the full gradient of a parameter; the default reads `p.grad`. Under ZeRO, where
    `p.grad` is partitioned or None, pass DeepSpeed's `safe_get_full_grad`.
    """
    sq: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        g = grad_of(p)
        if g is None:
            continue
        index = layer_index(name)
        key = f"grad/norm/L{index}" if index is not None else f"grad/norm/{name.split('.')[0]}"
        sq[key] = sq.get(key, 0) + g.detach().float().pow(2).sum()
    if not sq:
        return {}
    keys = list(sq)
    values = torch.stack([sq[k] for k in keys])
    out = dict(zip(keys, values.sqrt().tolist(), strict=False))
    out["grad/global"] = values.sum().sqrt().item()
    return out

"""Document masking in the model: a packed window, masked, gives each document what it gets alone.

The reference is the same model run on each document separately (positions from 0, plain causal attention),
and, for the probes, softmax statistics recomputed in float64 from those per-document runs.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from model import Transformer, attention
from model.probes import record
from model.rope import RoPE
from tests.helpers.model import tiny_config

# Two rows of 16 tokens, each packing several documents (a 1-token document included).
LENGTHS = ([5, 1, 7, 3], [9, 7])
T = 16
CONFIGS = {
    "default": {},
    "qk_norm+attn_softcap": {"qk_norm": "head", "attn_softcap": 3.0},
    "post": {"placement": "post", "n_kv_heads": 4},
}


def packed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [2, T] and their position_ids (0 at each document start)."""
    tokens = torch.randint(0, 97, (len(LENGTHS), T), generator=torch.Generator().manual_seed(seed))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    return tokens, positions


def documents(tokens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of every document of the packed batch."""
    out = []
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            out.append((b, start, n))
            start += n
    return out


def model(name: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**CONFIGS[name])).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_masked_logits_equal_each_document_alone(name: str) -> None:
    m = model(name)
    tokens, positions = packed()
    with torch.no_grad():
        got = m(tokens, position_ids=positions)
        for b, start, n in documents(tokens):
            alone = m(tokens[b:b + 1, start:start + n])[0]
            torch.testing.assert_close(got[b, start:start + n], alone, atol=1e-5, rtol=1e-5)
        # and the plain (unmasked) packed forward does not: the documents really see each other there
        assert not torch.allclose(m(tokens), got, atol=1e-3)


def test_rope_positions_restart_at_each_document() -> None:
    """The post-RoPE q and k of the packed window are each document's own. (Under the mask the logits alone
    cannot show this: RoPE scores depend only on relative positions.)"""
    m = model("default")
    tokens, positions = packed()
    seen = []
    handle = m.layers[0].attn.rope.register_forward_hook(lambda mod, args, out: seen.append(out))
    with torch.no_grad():
        m(tokens, position_ids=positions)
        for b, start, n in documents(tokens):
            m(tokens[b:b + 1, start:start + n])
    handle.remove()
    (q, k), alone = seen[0], seen[1:]
    for (b, start, n), (q1, k1) in zip(documents(tokens), alone, strict=True):
        torch.testing.assert_close(q[b, :, start:start + n], q1[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(k[b, :, start:start + n], k1[0], atol=1e-6, rtol=1e-5)


def test_loss_is_the_token_weighted_mean_over_documents() -> None:
    m = model("default")
    tokens, positions = packed()
    targets = torch.randint(0, 97, tokens.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = m(tokens, targets=targets, position_ids=positions, loss_chunk_size=5)
        total, count = 0.0, 0
        for b, start, n in documents(tokens):
            logits = m(tokens[b:b + 1, start:start + n])[0].double()
            total += F.cross_entropy(logits, targets[b, start:start + n], reduction="sum").item()
            count += n
    assert loss.item() == pytest.approx(total / count, rel=1e-6)


def test_gradients_flow_with_activation_checkpointing() -> None:
    """The recompute path (checkpointed blocks) gets the same mask: same loss and gradients as without it."""
    grads = []
    tokens, positions = packed()
    for checkpointing in (False, True):
        m = model("default").train()
        m.activation_checkpointing = checkpointing
        m(tokens[:, :-1], targets=tokens[:, 1:], position_ids=positions[:, :-1]).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _reference_stats(m: Transformer, tokens: torch.Tensor, rows: torch.Tensor, threshold: float,
                     softcap: float | None) -> list[dict[str, float]]:
    """Per layer: the probes' statistics (mean over heads), from per-document runs in float64, for the packed
    batch's query `rows` (row 0 of the batch only, as the Recorder's attn_batch=1)."""
    qk: dict[int, list] = {i: [] for i in range(len(m.layers))}
    handles = [layer.attn.rope.register_forward_hook(lambda mod, a, out, i=i: qk[i].append(out))
               for i, layer in enumerate(m.layers)]
    docs = [d for d in documents(tokens) if d[0] == 0]
    with torch.no_grad():
        for _, start, n in docs:
            m(tokens[:1, start:start + n])
    for h in handles:
        h.remove()
    out = []
    for layer in range(len(m.layers)):
        per_row = []  # (max_prob [H], entropy [H], saturated [H], max logit [H]) of each usable row
        for (_, start, n), (q, k) in zip(docs, qk[layer], strict=True):
            q, k = q[0].double(), k[0].double()  # [H, n, D], [K, n, D]
            k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
            for r in rows.tolist():
                i = r - start
                if not 0 < i < n:  # not in this document, or its first token (sees only itself)
                    continue
                s = torch.einsum("hd,hjd->hj", q[:, i], k[:, :i + 1]) / math.sqrt(q.shape[-1])  # [H, i+1]
                capped = s if softcap is None else softcap * torch.tanh(s / softcap)
                p = capped.softmax(-1)
                ent = -(p * p.log()).sum(-1) / math.log(i + 1)
                per_row.append((p.amax(-1), ent, (p.amax(-1) >= threshold).double(), s.amax(-1)))
        stack = [torch.stack(x) for x in zip(*per_row, strict=True)]  # each [R, H]
        out.append({"max_prob": stack[0].mean().item(), "entropy": stack[1].mean().item(),
                    "saturated_frac": stack[2].mean().item(), "max_logit": stack[3].amax(0).mean().item(),
                    "entropy_worst": stack[1].mean(0).amin().item()})
    return out


@pytest.mark.parametrize("name", ["default", "qk_norm+attn_softcap"])
def test_probe_statistics_equal_per_document_statistics(name: str) -> None:
    m = model(name)
    with torch.no_grad():  # sharpen the random model's attention, so that which keys are visible matters
        for layer in m.layers:
            layer.attn.q_proj.weight.mul_(4.0)
            layer.attn.k_proj.weight.mul_(4.0)
    tokens, positions = packed()
    threshold = 0.6  # some rows of this model count as saturated, some not
    with torch.no_grad(), record(m, attn_rows=T, saturation_threshold=threshold) as rec:
        m(tokens, position_ids=positions)
    got = rec.scalars()
    expected = _reference_stats(m, tokens, torch.arange(T), threshold, m.cfg.attn_softcap)
    assert any(e["saturated_frac"] not in (0.0, 1.0) for e in expected)  # the saturation check is not vacuous
    for layer, ref in enumerate(expected):
        for key, value in ref.items():
            assert got[f"attn/{key}/L{layer}"] == pytest.approx(value, abs=1e-5), (key, layer)
    # without the mask the statistics differ (keys of other documents are visible)
    with torch.no_grad(), record(m, attn_rows=T, saturation_threshold=threshold) as plain:
        m(tokens)
    for key in ("entropy", "max_prob"):
        assert plain.scalars()[f"attn/{key}/L0"] != pytest.approx(got[f"attn/{key}/L0"], abs=1e-3)


def test_generation_and_bad_positions_are_refused() -> None:
    m = model("default")
    tokens, positions = packed()
    with pytest.raises(ValueError, match="document masking is for training"):
        m(tokens, cache=m.new_cache(2), position_ids=positions)
    with pytest.raises(ValueError, match="position_ids"):
        m(tokens, position_ids=positions[:, :-1])


def _eager_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def quiet(*args, **kwargs):  # eager flex on CPU warns that it is unfused: expected here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(*args, **kwargs)

    return quiet, create_block_mask


def test_flex_attention_path_gives_each_document_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (flex attention with a block mask built from the doc ids), run eagerly on CPU: same result
    as the per-document reference. On CUDA it is compiled; `test_flex_on_cuda` runs that where there is a GPU."""
    monkeypatch.setattr(attention, "_use_flex", lambda device: True)
    monkeypatch.setattr(attention, "_flex", _eager_flex)
    m = model("default")
    tokens, positions = packed()
    mask = attention.DocumentMask.from_positions(positions)
    assert mask.block is not None and mask.dense is None
    with torch.no_grad():
        got = m(tokens, position_ids=positions)
        for b, start, n in documents(tokens):
            torch.testing.assert_close(got[b, start:start + n], m(tokens[b:b + 1, start:start + n])[0],
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled flex attention)")
def test_flex_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    m = model("default").cuda()
    tokens, positions = (t.cuda() for t in packed())
    assert attention.DocumentMask.from_positions(positions).block is not None
    with torch.no_grad():
        flex = m(tokens, position_ids=positions)
        monkeypatch.setenv("NORMLAB_DOCMASK", "sdpa")
        assert attention.DocumentMask.from_positions(positions).block is None
        sdpa = m(tokens, position_ids=positions)
    torch.testing.assert_close(flex, sdpa, atol=1e-4, rtol=1e-4)


def test_rope_module_sees_document_positions() -> None:
    """RoPE at per-row positions is RoPE at each document's own positions (what the probes hook reads)."""
    from model.rope import rope_cos_sin, rope_cos_sin_at

    _, positions = packed()
    cos, sin = rope_cos_sin_at(positions, 8, 10000.0)
    ref_cos, ref_sin = rope_cos_sin(T, 8, 10000.0)
    assert torch.equal(cos, ref_cos[positions]) and torch.equal(sin, ref_sin[positions])
    q = torch.randn(2, 3, T, 8)
    q_rot, _ = RoPE()(q, q, cos, sin)
    torch.testing.assert_close(q_rot[1, :, 9:], RoPE()(q[1:, :, 9:], q[1:, :, 9:], *rope_cos_sin(7, 8, 1e4))[0][0])


@pytest.mark.slow
def test_compiled_blocks_take_the_mask() -> None:
    """`compile_blocks` (regional torch.compile) runs the masked blocks as eager does (~20 s of compiling)."""
    from model.optimize import compile_blocks

    m = model("default")
    tokens, positions = packed()
    with torch.no_grad():
        eager = m(tokens, position_ids=positions)
        compile_blocks(m)
        torch.testing.assert_close(m(tokens, position_ids=positions), eager, atol=1e-5, rtol=1e-5)

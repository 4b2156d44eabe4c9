"""Activation checkpointing and regional compilation change speed/memory, never the numbers."""
import pytest
import torch

from model import ModelConfig, Transformer
from model.optimize import compile_blocks, enable_activation_checkpointing
from model.probes import record


def _loss_and_grads(model, x, y):
    model.zero_grad()
    loss = model(x, targets=y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_gives_identical_gradients():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, qk_norm="head"))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    ref_loss, ref = _loss_and_grads(model, x, y)
    enable_activation_checkpointing(model)
    loss, got = _loss_and_grads(model, x, y)
    assert torch.equal(loss, ref_loss)
    assert all(torch.allclose(ref[n], got[n], atol=1e-7) for n in ref)


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_keep_hooks_and_probes_working():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, placement="sandwich"))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    ref_loss, ref = _loss_and_grads(model, x, y)
    with record(model) as rec:
        model(x)
    eager_probes = rec.scalars()
    names = [n for n, _ in model.named_parameters()]

    compile_blocks(model)
    assert [n for n, _ in model.named_parameters()] == names  # compiled in place: the state dict is unchanged
    seen = []
    model.layers[1].register_forward_hook(lambda m, args, out: seen.append(out.value().shape))
    loss, got = _loss_and_grads(model, x, y)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    assert all(torch.allclose(ref[n], got[n], atol=1e-5) for n in ref)
    assert seen == [(2, 16, 32)]
    # The probes' hooks, added after compiling, still see everything (and are gone afterwards), in both orders.
    for _ in range(2):
        with record(model) as rec:
            model(x)
        assert rec.scalars().keys() == eager_probes.keys()
        assert all(rec.scalars()[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in eager_probes.items())
        rec.values.clear()
        model(x)
        assert rec.values == {}

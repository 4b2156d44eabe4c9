"""Activation checkpointing and regional compilation change speed/memory, never the numbers."""
import pytest
import torch

from model import ModelConfig, Transformer
from model.optimize import compile_blocks, enable_activation_checkpointing


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
def test_compiled_blocks_match_eager():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, placement="sandwich"))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    ref_loss, ref = _loss_and_grads(model, x, y)
    compile_blocks(model)
    loss, got = _loss_and_grads(model, x, y)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    assert all(torch.allclose(ref[n], got[n], atol=1e-5) for n in ref)

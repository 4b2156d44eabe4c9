"""The chunked, fused LM-head cross-entropy against F.cross_entropy in float64."""
import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.loss import fused_linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_matches_float64_reference(chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 30, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (2, 30))
    y[0, :5] = -100  # ignored positions
    loss = fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
    (loss * 3).backward()

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.t()).flatten(0, 1), y.flatten(), ignore_index=-100)
    (ref * 3).backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    assert torch.allclose(h.grad.double(), h64.grad, atol=1e-5)
    assert torch.allclose(w.grad.double(), w64.grad, atol=1e-5)


def test_model_loss_path_equals_logits_path():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, tie_embeddings=True))
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))
    fused = model(x, targets=y, loss_chunk_size=10)
    fused.backward()
    g_fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    plain.backward()
    assert fused.item() == pytest.approx(plain.item(), abs=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(g_fused[n], p.grad, atol=1e-6), n


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size=0"):
        fused_linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 0)


@pytest.mark.parametrize("z_loss, softcap", [(1e-2, None), (0.0, 3.0), (0.5, 2.0)])
@pytest.mark.parametrize("chunk", [7, 1000])
def test_z_loss_and_softcap_match_float64_reference(z_loss, softcap, chunk):
    """Loss, z term and gradients against F.cross_entropy + w·mean(logsumexp²) on materialized float64 logits."""
    torch.manual_seed(0)
    h = (torch.randn(2, 30, 16) * 2).requires_grad_()  # large logits, so the cap and the z term both bite
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (2, 30))
    y[1, -4:] = -100
    loss, z_term = fused_linear_cross_entropy(h, w, y, chunk_size=chunk, z_loss=z_loss, softcap=softcap,
                                              return_z_loss=True)
    (loss * 3).backward()

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = (h64 @ w64.t()).flatten(0, 1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = y.flatten() != -100
    ref_z = z_loss * logits.logsumexp(-1)[valid].square().mean()
    ref = F.cross_entropy(logits, y.flatten(), ignore_index=-100) + ref_z
    (ref * 3).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert z_term.item() == pytest.approx(ref_z.item(), rel=1e-5, abs=1e-12) and not z_term.requires_grad
    assert torch.allclose(h.grad.double(), h64.grad, atol=1e-5)
    assert torch.allclose(w.grad.double(), w64.grad, atol=1e-5)


def test_logit_softcap_bounds_plain_logits_and_matches_the_loss_path():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, logit_softcap=0.5))
    x, y = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    logits = model(x)
    assert logits.abs().max() < 0.5  # c · tanh(·/c) bounds the logits by c
    capped = 0.5 * torch.tanh(F.linear(model.hidden_states(x), model.head_weight) / 0.5)
    assert torch.allclose(logits, capped, atol=1e-6)
    plain = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert model(x, targets=y, loss_chunk_size=5).item() == pytest.approx(plain.item(), abs=1e-6)


def test_bad_z_loss_and_softcap():
    with pytest.raises(ValueError, match="z_loss=-1"):
        fused_linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), z_loss=-1)
    with pytest.raises(ValueError, match="logit_softcap=0"):
        ModelConfig(logit_softcap=0)

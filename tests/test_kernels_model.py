"""A tiny model gives the same logits and trains identically with the fused kernels forced on and off.

Covers every way the model calls the kernels: pre-norm fused add (Qwen3, GPT-2 with LayerNorm), per-head
QK-norm over head_dim rows (Qwen3), QK-norm over the whole projection with the Gemma cast and output
norms (OLMo 2), sandwich norms with the (1 + w) gain, and the final norm.
"""
import pytest
import torch

from model import ModelConfig, Transformer  # noqa: E402
from tests.test_kernels_accuracy import TRITON  # sets TRITON_INTERPRET first on CPU-only machines

SIZES = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
CONFIGS = {
    "qwen3": dict(preset="qwen3"),
    "olmo2": dict(preset="olmo2"),
    "gpt2": dict(preset="gpt2"),
    "sandwich-offset": dict(preset="llama", placement="sandwich", norm_offset=True, norm_cast="gemma"),
}


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("NORMLAB_KERNELS", raising=False)


@pytest.fixture
def full_fp32_matmuls():
    """TF32 matmuls would round the ~1e-7 differences between the two norm paths up to ~1e-3."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def _perturb_gains(model: Transformer) -> None:
    """Init leaves every gain at exactly 1 (or 0 with the offset): move them so the gain paths are exercised."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def _train(cfg: ModelConfig, state: dict, device: str, steps: int = 3) -> tuple[torch.Tensor, list[float], dict]:
    model = Transformer(cfg).to(device)
    model.load_state_dict(state)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (steps, 2, cfg.max_seq_len + 1), generator=gen).to(device)
    with torch.no_grad():
        logits = model(tokens[0, :, :-1])
    # SGD, not Adam: Adam rescales gradients that are zero up to rounding (e.g. a key bias, which softmax
    # ignores) into full-size steps, turning 1e-9 noise into 1e-2 differences
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in tokens:
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return logits, losses, model.state_dict()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kernels, device", [
    pytest.param("triton", DEVICE, marks=pytest.mark.skipif(
        TRITON not in ("cuda", "interpreter"), reason=f"Triton state {TRITON!r} (see test_kernels_accuracy.py)")),
    ("auto", "cpu"),  # the C++ RMSNorm (and native F.layer_norm)
])
@pytest.mark.parametrize("name", CONFIGS)
def test_training_matches_with_kernels_on_and_off(name, kernels, device, full_fp32_matmuls):
    options = dict(CONFIGS[name])
    cfg = ModelConfig.preset(options.pop("preset"), **SIZES, **options, kernels="torch")
    torch.manual_seed(0)
    reference_model = Transformer(cfg)
    _perturb_gains(reference_model)
    state = reference_model.state_dict()

    logits_off, losses_off, state_off = _train(cfg, state, device)
    logits_on, losses_on, state_on = _train(cfg.replace(kernels=kernels), state, device)

    torch.testing.assert_close(logits_on, logits_off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(losses_on), torch.tensor(losses_off), rtol=1e-5, atol=1e-6)
    for key, value in state_off.items():
        torch.testing.assert_close(state_on[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")

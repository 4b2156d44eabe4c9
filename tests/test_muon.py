"""`optim.name: muon`: torch.optim.Muon on the blocks' matrices, AdamW on the rest, as one optimizer — against a
float64 reference step, through a Lightning fit and its exact resume, and refused under DeepSpeed, whose own Muon
computes another update (measured here). Under FSDP2: tests/test_fsdp2_units.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from model import ModelConfig, Transformer
from tests.helpers.multiproc import REPO, cpu_env, free_port, run_normlab
from tests.test_branch import HELPERS, ckpt, fit, lightning_state
from tests.test_optim_groups import adamw_reference
from training.optim import OptimConfig, build_optimizer, named_kinds

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

# torch.optim.Muon's quintic Newton–Schulz coefficients and its eps (torch/optim/_muon.py)
NS_COEFFICIENTS, NS_EPS = (3.4445, -4.7750, 2.0315), 1e-7


def newton_schulz64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonalization Muon documents, in float64: X ← aX + (bA + cA²)X with A = XXᵀ, from X = G/‖G‖_F,
    on the wide orientation (transposed when G has more rows than columns)."""
    a, b, c = NS_COEFFICIENTS
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp_min(NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_reference(p, grads, lr, wd, momentum, adjust="match_rms_adamw"):
    """Muon (Jordan et al. 2024) as torch.optim.Muon defines it: buf ← μ·buf + (1−μ)·g; Nesterov u = (1−μ)·g + μ·buf;
    p ← p·(1 − lr·wd) − lr'·NS(u), lr' = 0.2·√max(A, B)·lr (match_rms_adamw) or √max(1, A/B)·lr (original)."""
    A, B = p.shape
    lr_adj = lr * (0.2 * max(A, B) ** 0.5 if adjust == "match_rms_adamw" else max(1, A / B) ** 0.5)
    p, buf = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        update = (1 - momentum) * g + momentum * buf
        p = p * (1 - lr * wd) - lr_adj * newton_schulz64(update)
    return p


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("gpt2", vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                          tie_embeddings=False, mlp="gelu"))


def train(model: Transformer, cfg: OptimConfig, steps: int, opt=None, seed: int = 1):
    """`steps` updates from seeded Gaussian gradients (full rank: the bfloat16 Newton–Schulz torch runs then agrees with
    float64 to ~2%; a real gradient's tiny singular values would amplify its rounding); returns them per parameter."""
    opt = opt or build_optimizer(model, cfg, total_steps=10)[0]
    gen = torch.Generator().manual_seed(seed)
    grads = {n: [] for n, _, _ in named_kinds(model)}
    for _ in range(steps):
        for n, p, _ in named_kinds(model):
            p.grad = torch.randn(p.shape, generator=gen)
            grads[n].append(p.grad.clone())
        opt.step()
        opt.zero_grad()
    return opt, grads


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_drives_the_block_matrices_and_adamw_the_rest(adjust):
    model = tiny()
    start = {n: p.detach().clone() for n, p, _ in named_kinds(model)}
    cfg = OptimConfig(name="muon", lr=2e-2, warmup_steps=0, schedule="constant",
                      options={"momentum": 0.9, "adjust_lr": adjust})
    opt, grads = train(model, cfg, steps=3)
    algorithm = {id(p): (g["algorithm"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    for name, p, kind in named_kinds(model):
        alg, wd = algorithm[id(p)]
        assert alg == ("muon" if kind == "weight" else "adamw"), name
        if alg == "adamw":
            torch.testing.assert_close(p.detach().double(), adamw_reference(start[name], grads[name], [2e-2] * 3, wd),
                                       rtol=1e-5, atol=1e-7)
            continue
        want = muon_reference(start[name], grads[name], 2e-2, wd, 0.9, adjust)
        # torch runs Newton–Schulz in bfloat16: the update agrees with the float64 one to ~2%
        moved, want_moved = p.detach().double() - start[name].double(), want - start[name].double()
        assert (moved - want_moved).norm() / want_moved.norm() < 0.04, name


def test_state_dict_round_trip_continues_exactly():
    """One optimizer state for both algorithms: save after a step, load into a fresh optimizer, step on — the same
    weights as never stopping."""
    cfg = OptimConfig(name="muon", lr=1e-2, warmup_steps=0, schedule="constant")
    ref = tiny()
    ref_opt, _ = train(ref, cfg, steps=1)
    train(ref, cfg, steps=1, opt=ref_opt, seed=2)
    model = tiny()
    opt, _ = train(model, cfg, steps=1)
    state = opt.state_dict()
    assert {g["algorithm"] for g in state["param_groups"]} == {"muon", "adamw"}
    assert len(state["state"]) == len(list(model.parameters()))  # momentum buffers and Adam moments, one dict
    fresh, _ = build_optimizer(model, cfg, total_steps=10)
    fresh.load_state_dict(state)
    train(model, cfg, steps=1, opt=fresh, seed=2)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_muon_fit_resumes_exactly(workdir):
    """Through Lightning: the combined optimizer checkpoints and a resume from step 4 ends on the same weights."""
    trunk = fit(workdir, "muon", "--optim.name", "muon")
    resumed = fit(workdir, "muon-resumed", "--optim.name", "muon", "--ckpt_path", str(ckpt(trunk, 4) / "model.ckpt"))
    final, again = lightning_state(trunk, 8)["state_dict"], lightning_state(resumed, 8)["state_dict"]
    assert all(torch.equal(final[k], again[k]) for k in final)
    assert any(g["algorithm"] == "muon" for g in lightning_state(trunk, 8)["optimizer_states"][0]["param_groups"])


@pytest.mark.slow
def test_muon_under_deepspeed_is_one_line(workdir):
    proc = run_normlab(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                        str(workdir / "runs"), "--name", "muon-ds", "--trainer.strategy", "zero1",
                        "--trainer.devices", "1", "--optim.name", "muon"], cwd=workdir, expect_ok=False)
    assert proc.returncode != 0
    assert "optim.name=muon does not run under DeepSpeed" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_deepspeeds_own_muon_computes_another_update(tmp_path):
    """Why the refusal stays (registry.py's `zero_refusal`): DeepSpeed 0.19's Muon, set as alike as it allows, vs
    training/optim's on one update of the same weights and batch (tests/helpers/deepspeed_muon.py). Without ZeRO its
    block-matrix updates agree to ~1% — the comparison is sound (bfloat16 Newton–Schulz in another op order) —
    under ZeRO-1/2 they are a few percent of ours, far outside fp32 tolerance; and it drives the untied LM head
    with Muon. (If DeepSpeed's ZeRO path comes to agree, this fails: offer it then.)"""
    out = tmp_path / "muon.json"
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.deepspeed_muon", str(out)], cwd=REPO, timeout=600,
                          env=cpu_env(MASTER_PORT=str(free_port())), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    blocks = result["normlab_muon"]
    control = result["stages"]["0"]["updates"]
    assert all(abs(control[n]["norm_ratio"] - 1) < 0.02 and control[n]["cosine"] > 0.99 for n in blocks), control
    for stage in ("1", "2"):
        updates = result["stages"][stage]["updates"]
        assert all(0.03 < updates[n]["norm_ratio"] < 0.05 and 0.8 < updates[n]["cosine"] < 0.97 for n in blocks), \
            (stage, updates)
        assert set(result["stages"][stage]["deepspeed_muon"]) - set(blocks) == {"output.weight"}


def test_muon_on_a_torch_without_it_is_one_line(workdir, monkeypatch, capsys):
    """PyTorch before 2.9 has no torch.optim.Muon (pyproject allows older torch): refused at parse time, nothing
    written. The attribute is removed here as an older torch lacks it."""
    from training.cli import main

    monkeypatch.delattr(torch.optim, "Muon")
    runs = workdir / "runs-old-torch"
    code = main(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                 str(runs), "--name", "muon-old", "--optim.name", "muon"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert "optim.name=muon needs torch.optim.Muon" in line and "torch>=2.9" in line and torch.__version__ in line
    assert not runs.exists()

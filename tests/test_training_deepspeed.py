"""Real multi-process DeepSpeed on CPU (gloo): ZeRO 1/2/3 fits, exact resume, 2-node launches on loopback, and
consolidation of a sharded checkpoint into a plain `model.Transformer` state dict.

Runs are shared: the 2-rank ZeRO-2 run (Lightning's own launcher) is the reference that a resumed ZeRO-2 run
and 2-node launches (torchrun, deepspeed launcher) must reproduce bit for bit, and ZeRO-1 and ZeRO-3 to fp32
rounding (those through torchrun, which starts both ranks at once). These reference runs are the session's
(tests/helpers/zero_runs.py: tests/test_safe_loading.py crafts copies of the same checkpoints), and so is this
module's directory: every run here sits beside them. The module takes ~2-3 minutes on 2 idle cores, almost all
of it process start-up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import ModelConfig, Transformer
from tests.helpers.multiproc import REPO, cpu_env, free_port, run_deepspeed_nodes, run_torchrun
from tests.helpers.runs import consolidated_state_dict, scalars
from tests.helpers.zero_runs import fit_args

pytestmark = pytest.mark.slow

TAGS = ("train/loss", "train/lr", "val/loss", "probe/rng")


@pytest.fixture(scope="module")
def workdir(zero_workdir) -> Path:
    """The session's directory of the reference runs (tests/conftest.py): this module's runs resume and compare
    with them there."""
    return zero_workdir


def run_dir(workdir: Path, name: str) -> Path:
    return workdir / "runs" / name


@pytest.fixture(scope="module")
def zero2(zero2_run) -> Path:
    """The reference: 2 ranks, ZeRO-2, started by Lightning's own launcher."""
    return zero2_run


@pytest.fixture(scope="module")
def zero1(zero1_run) -> Path:
    return zero1_run


@pytest.fixture(scope="module")
def zero3(zero3_run) -> Path:
    return zero3_run


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def independent_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token counted from the built model, the usual 6N + attention (Kaplan et al., PaLM): 6 per
    parameter but the embedding lookup (the LM head counts; norm gains too, as in N), plus causal attention's QK^T
    and AV, 6·L·T·dim."""
    model = Transformer(config)
    matmul = sum(p.numel() for n, p in model.named_parameters()
                 if config.tie_embeddings or "tok_embeddings" not in n)
    return 6.0 * matmul + 6.0 * config.n_layers * seq_len * config.dim


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_fit_completes_and_learns(stage, request, zero2, single):
    run = request.getfixturevalue(stage)
    losses = scalars(run, "train/loss")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.1, losses
    for step in (4, 8):
        manifest = json.loads((ckpt(run, step) / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["zero_stage"] == int(stage[-1])
        assert manifest["world_size"] == 2 and manifest["format"] == "deepspeed"
        assert (ckpt(run, step) / "config.yaml").read_text().count(f"strategy: {stage}") == 1
    assert scalars(run, "val/ppl")[8] == pytest.approx(torch.tensor(scalars(run, "val/loss")[8]).exp().item(),
                                                       rel=1e-6)
    # MFU = tokens/s per device x FLOPs per token / the peak FLOP/s the run measured (and logged)
    config = ModelConfig(**json.loads((ckpt(run, 8) / "model_config.json").read_text()))
    tokens_per_sec, peak = scalars(run, "throughput/tokens_per_sec")[8], scalars(run, "throughput/peak_tflops")[0]
    assert tokens_per_sec > 0
    assert scalars(run, "throughput/mfu")[8] == pytest.approx(
        tokens_per_sec / 2 * independent_flops_per_token(config, 16) / (peak * 1e12), rel=1e-4)
    # ZeRO only partitions state: every stage computes the same steps as one plain process with the same global
    # batch. Not bit for bit: the global gradient norm (for clipping) is summed over differently partitioned
    # gradients, and the loss over other groupings, which can move the last bits.
    assert losses == pytest.approx(scalars(zero2, "train/loss"), rel=1e-6, abs=0)
    assert losses == pytest.approx(scalars(single, "train/loss"), rel=1e-5, abs=0)
    # QK-clip scaled heads at most steps (the runs' optim.qk_clip), the same heads as the plain process, after a
    # validation too: the partitioned weights were clipped as the plain process clips its own, or the losses and
    # weights here would part from the single run's
    clipped = scalars(run, "qk_clip/heads_clipped")
    assert clipped == scalars(single, "qk_clip/heads_clipped") and sum(v > 0 for v in clipped.values()) >= 6
    assert any(clipped[s] > 0 for s in range(5, 9)), clipped  # (tracking is back on after step 4's validation)
    plain = consolidated_state_dict(ckpt(single, 8), tmp_path_for(run))
    for name, tensor in consolidated_state_dict(ckpt(run, 8), tmp_path_for(run)).items():
        torch.testing.assert_close(tensor, plain[name], rtol=1e-5, atol=1e-6)


def tmp_path_for(run: Path) -> Path:
    scratch = run.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    return scratch


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_zero1_and_zero3_resume_exactly_on_the_same_world_size(stage, request, workdir):
    """The straight 8-step run of each stage, resumed from its own step 4 on the same 2 ranks: steps 5-8 log the
    same losses and reach bitwise the same weights."""
    run = request.getfixturevalue(stage)
    name = f"{stage}-resumed"
    run_torchrun(fit_args(workdir, name, stage, "--ckpt_path", str(ckpt(run, 4))), cwd=workdir)
    resumed = run_dir(workdir, name)
    losses = scalars(resumed, "train/loss")
    assert sorted(losses) == [5, 6, 7, 8]
    assert losses == {s: v for s, v in scalars(run, "train/loss").items() if s > 4}
    straight, again = (consolidated_state_dict(ckpt(r, 8), tmp_path_for(r)) for r in (run, resumed))
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_zero2_exact_resume(workdir, zero2, tmp_path):
    """8 straight steps vs. 6 steps (checkpoint at 4; 5 and 6 are lost, like a job killed between checkpoints)
    + resume from the last complete checkpoint to 8: identical per-step losses, LR, validation and RNG draws,
    each logged once in the same TensorBoard run, and bitwise-identical final weights."""
    run_torchrun(fit_args(workdir, "resumed", "zero2", probe="interrupted.yaml"), cwd=workdir)
    resumed = run_dir(workdir, "resumed")
    assert not ckpt(resumed, 8).exists() and max(scalars(resumed, "train/loss")) == 6
    run_torchrun(fit_args(workdir, "resumed", "zero2", "--ckpt_path", "last"), cwd=workdir)
    # resumed from step 4: a run that started over would have superseded it (moved aside into incomplete/) and
    # still logged the same numbers
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]
    for tag in TAGS:
        assert scalars(resumed, tag) == scalars(zero2, tag), tag  # dict equality: same steps, same floats
    straight = consolidated_state_dict(ckpt(zero2, 8), tmp_path)
    again = consolidated_state_dict(ckpt(resumed, 8), tmp_path)
    assert straight.keys() == again.keys()
    assert all(torch.equal(straight[k], again[k]) for k in straight)


@pytest.mark.parametrize("launcher", [run_torchrun, run_deepspeed_nodes], ids=["torchrun", "deepspeed"])
def test_two_nodes_match_single_node(workdir, zero2, launcher):
    """Two "nodes" of one process each on loopback: torchrun (`--nnodes 2 --nproc-per-node 1`, two launchers)
    and the deepspeed launcher's per-node launcher (whose CROSS_RANK normlab maps to Lightning's NODE_RANK)."""
    name = f"two-nodes-{launcher.__name__}"
    args = fit_args(workdir, name, "zero2")
    args[args.index("--trainer.devices") + 1] = "1"
    if launcher is run_torchrun:
        run_torchrun([*args, "--trainer.num_nodes", "2"], cwd=workdir, nnodes=2, nproc_per_node=1)
    else:
        run_deepspeed_nodes([*args, "--trainer.num_nodes", "2"], cwd=workdir, nnodes=2)
    run = run_dir(workdir, name)
    assert json.loads((ckpt(run, 8) / "manifest.json").read_text())["world_size"] == 2
    assert scalars(run, "train/loss") == scalars(zero2, "train/loss")


@pytest.mark.parametrize("script", ["launch_torchrun.sh", "launch_deepspeed.sh"])
def test_launcher_scripts_launch_two_processes(workdir, zero2, script):
    """scripts/launch_torchrun.sh and scripts/launch_deepspeed.sh (one node, no hostfile: 2 processes on a CPU
    machine) start the reference's run, which logs the reference's losses bit for bit. (scripts/slurm.sbatch
    needs SLURM's srun: untested here.)"""
    name = f"script-{script.removesuffix('.sh')}"
    args = fit_args(workdir, name, "zero2")[1:]  # the scripts run `fit` themselves,
    for flag in ("--trainer.strategy", "--trainer.devices"):  # and choose these (zero2, 2 processes without a GPU)
        del args[args.index(flag):args.index(flag) + 2]
    # the scripts call `python`, `torchrun` and `deepspeed`: those of the interpreter running the tests
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    proc = subprocess.run(["bash", str(REPO / "scripts" / script), *args], check=False, cwd=workdir,
                          capture_output=True, text=True, timeout=300,
                          env=cpu_env(MASTER_PORT=str(free_port()), ACCELERATOR="cpu", PATH=path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = run_dir(workdir, name)
    assert json.loads((ckpt(run, 8) / "manifest.json").read_text())["world_size"] == 2
    assert scalars(run, "train/loss") == scalars(zero2, "train/loss")


def test_zero3_checkpoint_consolidates_into_transformer(zero3, zero2, tmp_path):
    """A ZeRO-3 checkpoint (every parameter sharded across ranks) → one plain state dict → `model.Transformer`."""
    state = consolidated_state_dict(ckpt(zero3, 8), tmp_path)
    config = ModelConfig(**json.loads((ckpt(zero3, 8) / "model_config.json").read_text()))
    model = Transformer(config)
    model.load_state_dict(state, strict=True)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    reference = consolidated_state_dict(ckpt(zero2, 8), tmp_path)
    for name, tensor in reference.items():  # ZeRO-3 trained the same weights (to the last bits, see above)
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-8)
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    assert torch.isfinite(model(tokens)).all()


# ---- training-health metrics and evaluation of DeepSpeed checkpoints (they reuse the runs above) -------------
@pytest.fixture(scope="module")
def single(single_run) -> Path:
    """The ZeRO-2 reference's batches in one plain process: 2 ranks x 4 samples = 8 per micro-batch."""
    return single_run


N_LAYERS = 2  # tests/helpers/tiny.yaml


@pytest.mark.parametrize("other", ["single", "zero1", "zero3"])
def test_layer_gradient_norms_agree_across_zero_stages(other, request, zero2):
    """Per-layer gradient norms at the step-0 init audit: ZeRO partitions (or, for ZeRO-3, shards) every gradient,
    so they must be reassembled — the values must equal the plain single-process run's."""
    run = request.getfixturevalue(other)
    for tag in [f"grad/norm/L{l}" for l in range(N_LAYERS)] + ["grad/global", "grad/norm/tok_embeddings"]:
        assert scalars(run, tag)[0] == pytest.approx(scalars(zero2, tag)[0], rel=1e-5), tag
    # Norm gains are parameters, gathered like the parameter norms (ZeRO-3 holds a shard of each): γ = 1 at init.
    for tag in [f"norm/gain_{s}/{role}/L{l}" for s in ("mean", "max") for role in ("attn_in", "mlp_in")
                for l in range(N_LAYERS)] + ["norm/gain_mean/final", "norm/gain_max/final"]:
        assert scalars(run, tag)[0] == scalars(zero2, tag)[0] == 1.0, tag
    if other != "single":  # probes read rank 0's micro-batch, which a single process does not share
        assert scalars(run, "resid/rms/L1")[0] == pytest.approx(scalars(zero2, "resid/rms/L1")[0], rel=1e-5)


def test_health_metrics_and_layout_in_tensorboard(zero2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(str(zero2), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    per_layer = ["resid/rms", "resid/rms_out", "resid/update_ratio/attn", "resid/update_ratio/mlp",
                 "resid/read_rms/attn", "resid/read_rms/mlp", "attn/max_prob", "attn/entropy",
                 "attn/saturated_frac", "attn/max_logit", "attn/max_logit_worst", "grad/norm", "param/norm",
                 "outlier/max_over_rms", "outlier/kurtosis", "attn/sink_mass", "attn/sink_mass_worst",
                 "norm/gain_mean/attn_in", "norm/gain_max/mlp_in", "attn/max_logit_exact", "attn/max_logit_exact_worst",
                 "optim/update_ratio/attn", "optim/update_ratio/mlp"]
    missing = [f"{stem}/L{l}" for stem in per_layer for l in range(N_LAYERS) if f"{stem}/L{l}" not in tags]
    assert not missing, missing
    assert {"resid/final_in", "grad/global", "train/loss", "train/lr",
            "throughput/tokens_per_sec", "throughput/mfu", "val/loss", "val/ppl"} <= tags
    # every 50 steps: the init audit and the last of the 8 updates (step 7) only
    assert sorted(scalars(zero2, "attn/entropy/L0")) == [0, 7]
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["Residual growth", "Softmax saturation", "Gradient flow",
                                                  "Outliers", "Stability"]
    titles = [chart.title for category in layout.category for chart in category.chart]
    assert "skipped steps (guard): empty until a step is skipped" in titles  # DeepSpeed's own skips count there
    assert not any(t.startswith("QK-norm gains") for t in titles)  # (tiny.yaml's model has no QK-norm)
    assert [e.step for e in acc.Images("profile/depth")] == [0, 7]  # the depth profile, on the metrics steps


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_evaluate_deepspeed_checkpoint_matches_logged_validation(stage, request, zero2, tmp_path, capsys):
    """`normlab evaluate` consolidates a 2-rank ZeRO checkpoint in one CPU process — this one, through the console
    script's entry point — and reproduces the run's own val/loss at that step; the JSON and the run's TensorBoard
    get the numbers."""
    import math

    from training.cli import main

    run = request.getfixturevalue(stage)
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--checkpoint", str(ckpt(run, 8)), "--output", str(out)]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["step"] == 8 and result["split"] == "val"
    assert result["loss"] == pytest.approx(scalars(run, "val/loss")[8], rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert 0 < result["bits_per_byte"] < 20
    assert scalars(run, "eval/val/loss") == {8: pytest.approx(result["loss"], rel=1e-6)}

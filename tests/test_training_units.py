"""Fast, single-process tests of the training pieces: optimizer groups, schedule, checkpoint naming and
resolution, RNG capture/restore, DeepSpeed config lookup, the LitLM override surface."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import types

import numpy as np
import pytest
import torch

from model import ModelConfig, Transformer
from training.callbacks.rng import capture_rng, restore_rng
from training.checkpointing import resume
from training.checkpointing.plan import resolve
from training.errors import CheckpointError, UserError
from training.lit_module import LitLM
from training.optim import OptimConfig, build_optimizer, lr_factor, param_groups
from training.run import layout
from training.strategy import ZERO_NAMES, DeepSpeed, adopt_deepspeed_launcher_env, load_deepspeed_config


def tiny(**kw) -> ModelConfig:
    return ModelConfig.preset(kw.pop("preset", "llama"), vocab_size=64, dim=32, n_layers=2, n_heads=4,
                              max_seq_len=16, **kw)


@pytest.mark.parametrize("preset", ["llama", "gpt2", "qwen3", "post"])
def test_param_groups_exclude_norms_biases_embeddings(preset):
    model = Transformer(tiny(preset=preset))
    groups = {g["name"]: g for g in param_groups(model, OptimConfig(weight_decay=0.1))}
    decay_ids = {id(p) for p in groups["decay"]["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    # decayed: exactly the matrices of linear layers (the LM head too, unless tied to the embedding)
    assert {names[i] for i in decay_ids} == {n for n, p in model.named_parameters()
                                             if p.ndim == 2 and "tok_embeddings" not in n}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    # every parameter exactly once (tied embeddings are one parameter)
    all_ids = [id(p) for g in groups.values() for p in g["params"]]
    assert len(all_ids) == len(set(all_ids)) == len(list(model.parameters()))


@pytest.mark.parametrize("norm", ["dyt", "none"])
def test_param_groups_treat_new_norms_like_gains(norm):
    """DyT's α, γ and β are norm parameters (no decay) in every placement and in QK-norm."""
    model = Transformer(tiny(norm=norm, qk_norm="head", placement="sandwich"))
    groups = {g["name"]: g for g in param_groups(model, OptimConfig(weight_decay=0.1))}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups["decay"]["params"]}
    assert decayed == {n for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n}
    if norm == "dyt":
        no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
        assert {"layers.0.attn.q_norm.alpha", "layers.0.attn_res.norm_out.alpha", "norm.weight",
                "layers.1.mlp_res.norm_in.bias"} <= no_decay


def test_param_groups_configurable():
    model = Transformer(tiny())
    groups = param_groups(model, OptimConfig(no_decay=()))
    assert [g["name"] for g in groups] == ["decay"]
    embed = model.tok_embeddings.weight
    groups = param_groups(model, OptimConfig(no_decay=("norm",)))
    assert any(p is embed for p in next(g for g in groups if g["name"] == "decay")["params"])


def test_schedule_shapes():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    f = [lr_factor(s, cfg, 110) for s in range(130)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warm-up, first step non-zero
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))  # monotone decay
    assert f[129] == pytest.approx(0.1)  # holds min_lr past the end
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear", decay_steps=100)
    assert lr_factor(50, lin, 10**9) == pytest.approx(0.5)  # decay_steps wins over total_steps
    const = OptimConfig(warmup_steps=5, schedule="constant")
    assert lr_factor(1000, const, 100) == 1.0


@pytest.mark.parametrize("shape, at_quarter", [
    ("linear", 1 - 0.9 * 0.25),  # 0.775
    ("cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # 0.8682
    ("1-sqrt", 1 - 0.9 * 0.5),  # 0.55
])
def test_wsd_schedule_by_hand(shape, at_quarter):
    """warm-up 10, 100 steps, decay over the last 20% (steps 80..100): 1 until 80, then the shape down to 0.1."""
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="wsd", decay_fraction=0.2, decay_shape=shape)
    f = {s: lr_factor(s, cfg, 100) for s in (0, 9, 10, 50, 79, 80, 85, 90, 100, 130)}
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == f[50] == f[79] == f[80] == 1.0  # stable
    assert f[85] == pytest.approx(at_quarter)
    mid = {"linear": 0.55, "cosine": 0.55, "1-sqrt": 1 - 0.9 * math.sqrt(0.5)}[shape]
    assert f[90] == pytest.approx(mid)
    assert f[100] == pytest.approx(0.1) and f[130] == pytest.approx(0.1)
    # decay_steps wins over total steps, and the fraction is of it: decay over 40..50, half-way at 45
    assert lr_factor(45, dataclasses.replace(cfg, decay_steps=50), 10**9) == pytest.approx(mid)


def test_build_optimizer_steps_the_schedule():
    model = Transformer(tiny())
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2), total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="decay_steps"):
        build_optimizer(model, OptimConfig(), total_steps=math.inf)


@pytest.mark.parametrize("bad, message", [
    (dict(schedule="exp"), r"optim.schedule='exp' is not valid"),
    (dict(no_decay=("gains",)), r"optim.no_decay has unknown kind\(s\) \['gains'\]"),
    (dict(min_lr=1.0, lr=0.1), r"lr > 0 and 0 <= min_lr <= lr, got lr=0.1, min_lr=1.0"),
    (dict(lr=-1.0, min_lr=0.0), r"lr > 0 .*got lr=-1.0"),
    (dict(warmup_steps=10, decay_steps=5), r"decay_steps > warmup_steps, got warmup_steps=10, decay_steps=5"),
    (dict(warmup_steps=-1), r"warmup_steps >= 0.*got warmup_steps=-1"),
    (dict(decay_shape="sqrt"), r"optim.decay_shape='sqrt' is not valid"),
    (dict(decay_fraction=0.0), r"optim.decay_fraction=0.0 must be in \(0, 1\]"),
    (dict(decay_fraction=1.5), r"optim.decay_fraction=1.5 must be in \(0, 1\]"),
    (dict(z_loss=-1e-4), r"optim.z_loss=-0.0001 must be >= 0"),
])
def test_optim_config_rejects(bad, message):
    """Each bad value is refused with a message naming that field and its value."""
    with pytest.raises(ValueError, match=message):
        OptimConfig(**bad)


def test_rng_capture_restore_roundtrip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(5), torch.rand(7)  # move every generator on
    restore_rng(state)
    assert random.random() == expected[0] and np.random.rand() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])
    # plain values and tensors only: loadable with weights_only=True
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    assert random.random() == expected[0]


def _fake_ckpt(run_dir, step, fmt="deepspeed", complete=True):
    d = layout.checkpoints_dir(run_dir) / layout.step_dirname(step)
    d.mkdir(parents=True)
    if complete:
        (d / layout.MANIFEST).write_text(json.dumps({"step": step, "format": fmt}))
    return d


def test_checkpoint_naming_and_last(tmp_path):
    assert layout.step_dirname(42) == "step-00000042"
    assert resolve("last", tmp_path) == (None, None)  # nothing yet: start fresh
    _fake_ckpt(tmp_path, 100)
    newest = _fake_ckpt(tmp_path, 1000)
    _fake_ckpt(tmp_path, 2000, complete=False)  # being written / crashed mid-save: never "last"
    (layout.checkpoints_dir(tmp_path) / "step-junk").mkdir()
    assert resolve("last", tmp_path) == (str(newest), 1000)  # numeric order, complete only
    lightning = _fake_ckpt(tmp_path / "other", 7, fmt="lightning")
    assert resolve(str(lightning), tmp_path) == (str(lightning / layout.LIGHTNING_FILE), 7)
    assert resolve(None, tmp_path) == (None, None)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(CheckpointError, match="--ckpt_path last"):
        resume.check_fresh_run(tmp_path)
    resume.check_fresh_run(tmp_path / "new-run")


@pytest.mark.parametrize("saved", ["deepspeed", "dcp", "lightning"])
def test_check_format(saved, tmp_path):
    """A checkpoint loads only under a strategy that writes its format; otherwise one line naming the strategy."""
    path = _fake_ckpt(tmp_path, 5, fmt=saved)
    if saved == "lightning":
        path = path / layout.LIGHTNING_FILE
        path.write_text("")
    resume.check_format(str(path), saved)
    hint = {"deepspeed": "DeepSpeed checkpoint: load it under DeepSpeed",
            "dcp": r"FSDP2 \(DCP\) checkpoint: load it under FSDP2 \(--trainer.strategy fsdp2",
            "lightning": "Lightning checkpoint file: load it under one device"}
    for other in {"deepspeed", "dcp", "lightning"} - {saved}:
        with pytest.raises(CheckpointError, match=hint[saved]):
            resume.check_format(str(path), other)


@pytest.mark.parametrize("name", ZERO_NAMES)
def test_zero_configs(name):
    cfg = load_deepspeed_config(name)
    assert cfg["zero_optimization"]["stage"] == int(name[-1])
    # Lightning fills these from the Trainer; DeepSpeed refuses a config that sets them twice
    assert "gradient_accumulation_steps" not in cfg and "train_micro_batch_size_per_gpu" not in cfg
    assert cfg["zero_allow_untested_optimizer"]  # our torch AdamW is a "client" optimizer


def test_deepspeed_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="zero1"):
        load_deepspeed_config("zero9")
    path = tmp_path / "mine.json"
    path.write_text('{"zero_optimization": {"stage": 2}}')
    assert load_deepspeed_config(str(path))["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("key, value", [("checkpoint", {"writer": {"type": "fast"}}), ("datastates_ckpt", {})])
def test_a_config_choosing_another_checkpoint_engine_is_refused(key, value):
    """normlab's saves hold each file write of DeepSpeed's default checkpoint engine (training/strategy.py)."""
    with pytest.raises(UserError, match=f"DeepSpeed config: {key}.* selects another checkpoint engine"):
        DeepSpeed(config={"zero_optimization": {"stage": 2}, key: value})
    DeepSpeed(config={"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": False}})


def test_deepspeed_launcher_node_rank():
    env = {"CROSS_RANK": "3"}
    adopt_deepspeed_launcher_env(env)
    assert env["NODE_RANK"] == "3"
    env = {"CROSS_RANK": "3", "NODE_RANK": "1"}
    adopt_deepspeed_launcher_env(env)
    assert env["NODE_RANK"] == "1"


def test_litlm_overrides_and_fail_fast():
    lit = LitLM(preset="olmo2", dim=64, n_heads=4, placement="post")
    cfg = lit.config
    assert (cfg.placement, cfg.qk_norm, cfg.dim, cfg.n_layers) == ("post", "full", 64, 4)
    assert lit.hparams["optim"]["lr"] == OptimConfig().lr and lit.hparams["placement"] == "post"
    with pytest.raises(ValueError, match="placement"):
        LitLM(placement="middle")


def test_compile_and_activation_checkpointing_switches_reach_the_model():
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=8, compile=True,
                activation_checkpointing=True)
    lit.configure_model()
    assert lit.model.activation_checkpointing
    assert all(layer._compiled_call_impl is not None for layer in lit.model.layers)  # nn.Module.compile's mark
    plain = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=8)
    plain.configure_model()
    assert not plain.model.activation_checkpointing
    assert not any(layer._compiled_call_impl is not None for layer in plain.model.layers)


def test_progress_bars_count_micro_batches_toward_max_steps():
    """Lightning's bars compare micro-batches with max_steps and the Rich one is titled "Epoch 0/-2" on an
    endless loader; normlab's swaps count max_steps × accumulation micro-batches under a plain title."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from training.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar, step_counting

    trainer = types.SimpleNamespace(max_steps=8, accumulate_grad_batches=2, global_step=3, max_epochs=-1)
    for default, swapped in ((RichProgressBar(), StepRichProgressBar), (TQDMProgressBar(), StepTQDMProgressBar)):
        bar = step_counting(default)
        assert type(bar) is swapped
        bar._trainer = trainer
        assert bar.total_train_batches == 16
    assert step_counting(StepRichProgressBar())._get_train_description(0).strip() == "Training"
    custom = type("Custom", (TQDMProgressBar,), {})()
    assert step_counting(custom) is custom  # not Lightning's own class: left alone

"""`optim.groups`: per-group LR multipliers and weight decay — against AdamW by hand in float64, through the schedule,
logged per group, carried by a resume and replaced by a branch's own settings."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from tests.helpers.runs import scalars
from tests.test_branch import ckpt, fit
from training.errors import UserError
from training.optim import OptimConfig, build_optimizer, named_kinds, param_groups

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

GROUPS = {"emb": {"kind": "embedding", "lr_mult": 0.5, "weight_decay": 0.01},
          "gains": {"kind": "norm", "lr_mult": 3.0},
          "queries": {"pattern": r"\.q_proj\.", "lr_mult": 2.0, "weight_decay": 0.2},
          "alpha": {"kind": "dyt_alpha", "lr_mult": 0.0}}


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.preset("gpt2", vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                          **{"tie_embeddings": False, **kw}))


def adamw_reference(p, grads, lr_per_step, wd, betas=(0.9, 0.95), eps=1e-8):
    """AdamW (Loshchilov & Hutter, decoupled decay as torch applies it: p ← p·(1 − lr·wd) − lr·m̂/(√v̂ + eps))."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, (g, lr) in enumerate(zip(grads, lr_per_step, strict=True), start=1):
        g = g.double()
        m, v = betas[0] * m + (1 - betas[0]) * g, betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p = p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def test_each_group_takes_an_adamw_step_with_its_own_lr_and_decay():
    model = tiny(norm="dyt")
    cfg = OptimConfig(lr=1e-2, warmup_steps=2, schedule="constant", groups=GROUPS)
    opt, schedule = build_optimizer(model, cfg, total_steps=10)
    start = {n: p.detach().clone() for n, p, _ in named_kinds(model)}
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in start}
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # warm-up: factor 0.5, then 1
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        for n, p, _ in named_kinds(model):
            grads[n].append(p.grad.detach().clone())
        opt.step()
        schedule.step()
        opt.zero_grad()
    expected_lr_mult = {"emb": 0.5, "gains": 3.0, "queries": 2.0, "alpha": 0.0, "decay": 1.0, "no_decay": 1.0}
    expected_wd = {"emb": 0.01, "gains": 0.0, "queries": 0.2, "alpha": 0.0, "decay": 0.1, "no_decay": 0.0}
    group_of = {id(p): g["name"] for g in opt.param_groups for p in g["params"]}
    for name, p, _ in named_kinds(model):
        group = group_of[id(p)]
        lr = 1e-2 * expected_lr_mult[group]
        want = adamw_reference(start[name], grads[name], [lr * 0.5, lr], expected_wd[group])
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-7, msg=f"{name} ({group})")
    assert group_of[id(model.layers[0].attn.q_proj.weight)] == "queries"
    assert group_of[id(model.layers[0].attn.q_proj.bias)] == "queries"
    assert group_of[id(model.output.weight)] == "decay"
    assert group_of[id(model.layers[1].mlp_res.norm_in.bias)] == "gains"
    assert torch.equal(model.norm.alpha, start["norm.alpha"])  # lr_mult 0: frozen


def test_kinds_tell_the_head_and_dyt_alpha_apart():
    kinds = {n: k for n, _, k in named_kinds(tiny(norm="dyt"))}
    assert kinds["output.weight"] == "head" and kinds["layers.0.attn.o_proj.weight"] == "weight"
    assert kinds["norm.alpha"] == "dyt_alpha" and kinds["norm.weight"] == "norm" and kinds["tok_embeddings.weight"] \
        == "embedding" and kinds["layers.0.attn.o_proj.bias"] == "bias"
    tied = {n: k for n, _, k in named_kinds(tiny(tie_embeddings=True))}
    assert "head" not in tied.values()  # a tied head is the embedding


def test_the_newer_scalars_have_kinds_of_their_own_no_decay_and_no_muon():
    """Branch scales, sink logits, an l2 QK-norm's temperature and Derf's α are kinds the model's modules declare
    (`param_kinds`): a group can select them, they do not decay by default, and Muon never drives them."""
    model = tiny(norm="derf", bias=False, branch_scale="vector", branch_scale_init=0.1, attn_sink="learnable",
                 qk_norm="head", qk_norm_kind="l2", attn_gate="head")
    kinds = {n: k for n, _, k in named_kinds(model)}
    assert kinds["layers.0.attn_res.branch_scale"] == "branch_scale" and kinds["layers.1.attn.sink.logit"] == \
        "attn_sink" and kinds["layers.0.attn.q_norm.temperature"] == "qk_temperature"
    assert kinds["norm.alpha"] == "dyt_alpha" and kinds["norm.shift"] == "norm"
    assert kinds["layers.0.attn.gate_proj.weight"] == "weight"  # a matrix like the others
    cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, groups={"g": {"kind": "branch_scale", "lr_mult": 10.0}})
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    in_group = {id(p): name for name, g in groups.items() for p in g["params"]}
    assert in_group[id(model.layers[0].mlp_res.branch_scale)] == "g" and groups["g"]["lr"] == pytest.approx(0.1)
    assert groups["g"]["weight_decay"] == 0.0
    for name in ("layers.1.attn.sink.logit", "layers.0.attn.q_norm.temperature", "norm.alpha"):
        assert in_group[id(model.get_parameter(name))] == "no_decay", name
    assert in_group[id(model.layers[0].attn.gate_proj.weight)] == "decay/muon"


@pytest.mark.parametrize(("groups", "message"), [
    ({"x": {"pattern": "nothing_like_this"}}, r"optim.groups.x \(pattern='nothing_like_this'\) matches no parameter"),
    ({"x": {"kind": "dyt_alpha"}}, r"optim.groups.x \(kind='dyt_alpha'\) matches no parameter"),
    ({"a": {"kind": "norm"}, "b": {"pattern": r"^norm\."}}, r"parameter 'norm.weight' \(kind norm\) is matched by both "
                                                             r"'a' and 'b'"),
    ({"a": {"pattern": "layers.0"}}, "optim.groups.a mixes kinds with and without weight decay"),
])
def test_bad_groups_are_one_clear_error(groups, message):
    with pytest.raises(UserError, match=message):
        param_groups(tiny(), OptimConfig(groups=groups))


@pytest.mark.parametrize(("groups", "message"), [
    ({"x": {"kind": "gains"}}, r"optim.groups.x.kind='gains' is not valid; choose one of \['norm', 'dyt_alpha'"),
    ({"x": {"lr": 2}}, r"optim.groups.x has unknown key\(s\) \['lr'\]"),
    ({"x": {"lr_mult": 2}}, "optim.groups.x selects nothing"),
    ({"decay": {"kind": "norm"}}, "optim.groups.decay: the name is reserved"),
    ({"x": {"pattern": "("}}, r"optim.groups.x.pattern='\(' is not a valid regex"),
    ({"x": {"kind": "head", "lr_mult": "3e-3"}}, "optim.groups.x needs numbers lr_mult >= 0"),
])
def test_bad_group_specs_fail_at_config_time(groups, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(groups=groups)


def test_groups_are_logged_follow_the_schedule_resume_and_branch(workdir):
    """Every group's LR is lr_mult × the schedule, logged as train/lr_<group>; a resume restores the groups; a
    branch runs with its own multipliers from its first update."""
    trunk_groups = "{emb: {kind: embedding, lr_mult: 0.5}}"
    trunk = fit(workdir, "groups-trunk", "--optim.groups", trunk_groups)
    base = scalars(trunk, "train/lr")
    assert sorted(base) == list(range(1, 9)) and base[1] < base[2]  # warm-up, then cosine: a moving schedule
    for tag, mult in (("train/lr_emb", 0.5), ("train/lr_decay", 1.0), ("train/lr_no_decay", 1.0)):
        assert scalars(trunk, tag) == pytest.approx({s: mult * v for s, v in base.items()}, rel=1e-6), tag

    resumed = fit(workdir, "groups-resumed", "--optim.groups", trunk_groups, "--ckpt_path",
                  str(ckpt(trunk, 4) / "model.ckpt"))
    assert scalars(resumed, "train/lr_emb") == pytest.approx({s: v for s, v in scalars(trunk, "train/lr_emb").items()
                                                              if s > 4}, rel=1e-6)

    branch = fit(workdir, "groups-branch", "--optim.groups", "{emb: {kind: embedding, lr_mult: 0.25}}",
                 "--branch_from", str(ckpt(trunk, 4)), "--optim.schedule", "constant")
    assert scalars(branch, "train/lr_emb") == pytest.approx({s: 0.25e-3 for s in (5, 6, 7, 8)}, rel=1e-6)
    assert scalars(branch, "train/lr_decay") == pytest.approx({s: 1e-3 for s in (5, 6, 7, 8)}, rel=1e-6)
    with pytest.raises(UserError, match=r"the checkpoint's optimizer groups are \['decay', 'no_decay', 'emb'\] and "
                                        r"this run's \['decay', 'no_decay'\]: resume or branch with"):
        fit(workdir, "groups-branch-bad", "--branch_from", str(ckpt(trunk, 4)))

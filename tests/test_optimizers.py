"""The optimizer registry (`optim.name`, `optim.options`; training/optim/registry.py): every registered optimizer
trains a tiny model through Lightning; a new one is one class and one registry entry, added here at runtime (plain
SGD with momentum, checked against a float64 reference and through `normlab fit`); options are typed and checked;
the flat Muon keys of older configs and checkpoints are handled."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from unittest import mock

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from model import ModelConfig, Transformer
from tests.helpers.multiproc import REPO
from tests.test_cli import run
from training.cli import main
from training.errors import DEBUG_ENV
from training.lit_module import LitLM
from training.optim import OptimConfig, build_optimizer, named_kinds
from training.optim.registry import OPTIMIZERS, Optimizer
from training.run.manifest import Manifest, file_sizes, hash_files

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

TINY = REPO / "tests" / "helpers" / "tiny.yaml"


@dataclass(frozen=True, kw_only=True)
class SGD(Optimizer):
    """torch.optim.SGD with heavy-ball momentum on every parameter (each group's weight decay as L2, torch's
    SGD convention): the smallest optimizer a user could add."""

    algorithm: ClassVar[str] = "sgd"

    momentum: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.momentum < 1:
            raise ValueError(f"optim.options.momentum={self.momentum} must be in [0, 1)")

    def build(self, groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=self.momentum)


@pytest.fixture
def sgd(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(OPTIMIZERS, "sgd", SGD)
    return "sgd"


def fit_steps(tmp_path: Path, optim: dict, steps: int = 2) -> tuple[LitLM, dict[str, torch.Tensor]]:
    """`steps` Lightning updates of a tiny LitLM with the `optim` group; returns it and its weights before them."""
    torch.manual_seed(0)
    lit = LitLM(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=8, optim={"warmup_steps": 0, **optim})
    lit.configure_model()
    start = {n: p.detach().clone() for n, p in lit.model.named_parameters()}
    tokens = torch.randint(0, 64, (2 * steps, 9))
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, DataLoader(tokens, batch_size=2))
    return lit, start


def check_trained(lit: LitLM, start: dict[str, torch.Tensor]) -> None:
    """Every parameter moved and stayed finite; the groups name the entry's algorithms, and the block matrices have
    groups of their own exactly when the entry drives them by another algorithm."""
    entry = OPTIMIZERS[lit.optim.name]
    for name, p in lit.model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, start[name]), name
    groups = lit.trainer.optimizers[0].param_groups
    matrix = entry.matrix_algorithm
    assert {g["algorithm"] for g in groups} == {entry.algorithm} | ({matrix} if matrix else set())
    assert any(g["name"].endswith(f"/{matrix}") for g in groups) == bool(matrix)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_registered_optimizer_trains_through_lightning(tmp_path, name):
    check_trained(*fit_steps(tmp_path, {"name": name, "lr": 1e-2}))


def test_a_new_optimizer_is_one_class_and_one_entry(sgd, tmp_path):
    """The toy SGD takes exactly the update SGD defines (float64), with its option, on every group."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("gpt2", vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16))
    cfg = OptimConfig(name=sgd, options={"momentum": 0.5}, lr=0.1, warmup_steps=0, schedule="constant")
    opt, _ = build_optimizer(model, cfg, total_steps=10)
    assert {g["algorithm"] for g in opt.param_groups} == {"sgd"} and opt.defaults["momentum"] == 0.5
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    start = {n: p.detach().double().clone() for n, p, _ in named_kinds(model)}
    want, buf = dict(start), {n: torch.zeros_like(p) for n, p in start.items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # buf ← μ·buf + (g + wd·p) (the first step: buf = g + wd·p);  p ← p − lr·buf
        for name, p, _ in named_kinds(model):
            p.grad = torch.randn(p.shape, generator=gen)
            buf[name] = 0.5 * buf[name] + p.grad.double() + decay[id(p)] * want[name]
            want[name] = want[name] - 0.1 * buf[name]
        opt.step()
    for name, p, _ in named_kinds(model):
        torch.testing.assert_close(p.detach().double(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    check_trained(*fit_steps(tmp_path, {"name": sgd, "options": {"momentum": 0.5}, "lr": 1e-2}))


def test_a_new_optimizer_is_a_command_line_choice(sgd, workdir):
    """`normlab fit --optim.name sgd --optim.options.momentum 0.5` with the toy registered: its checkpoint holds the
    SGD state, with the option as given."""
    with mock.patch.dict(os.environ, {DEBUG_ENV: "1"}):
        main(["fit", "-c", str(TINY), "--data.path", str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"),
              "--name", "sgd", "--trainer.max_steps", "2", "--trainer.devices", "1", "--trainer.logger", "false",
              "--metrics.every_n_steps", "0", "--checkpoint.every_n_steps", "2", "--optim.name", sgd,
              "--optim.options.momentum", "0.5"])
    state = torch.load(workdir / "runs" / "sgd" / "checkpoints" / "step-00000002" / "model.ckpt", weights_only=True)
    groups = state["optimizer_states"][0]["param_groups"]
    assert {g["algorithm"] for g in groups} == {"sgd"} and {g["momentum"] for g in groups} == {0.5}
    assert state["hyper_parameters"]["optim"]["options"] == {"momentum": 0.5}


@pytest.mark.parametrize("bad, message", [
    (dict(name="lion"), r"optim.name='lion' is not valid; choose one of \['adamw', 'muon', 'sgd'\]"),
    (dict(name="adamw", options={"momentum": 0.9}), r"optim.options.momentum is not an option of optim.name=adamw; "
                                                    r"adamw has no options"),
    (dict(name="muon", options={"momentum": 0.9, "beta": 1}), r"optim.options.beta is not an option of "
                                                              r"optim.name=muon; its options are \['momentum', "
                                                              r"'nesterov', 'ns_steps', 'adjust_lr'\]"),
    (dict(name="muon", options={"momentum": "0.9"}), r"optim.options.momentum='0.9' must be a number \(YAML"),
    (dict(name="muon", options={"ns_steps": 5.0}), r"optim.options.ns_steps=5.0 must be an integer"),
    (dict(name="muon", options={"nesterov": 1}), r"optim.options.nesterov=1 must be true or false"),
    (dict(name="muon", options={"adjust_lr": "spectral"}), r"optim.options.adjust_lr='spectral' is not valid; "
                                                          r"choose one of \['match_rms_adamw', 'original'\]"),
    (dict(name="muon", options={"momentum": 1.0}), r"0 <= momentum < 1 .*got momentum=1.0"),
    (dict(name="sgd", options={"momentum": True}), r"optim.options.momentum=True must be a number"),
    (dict(name="sgd", options=[0.9]), r"optim.options must be a mapping of sgd's settings"),
])
def test_options_are_typed_and_checked(sgd, bad, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**bad)


def test_an_old_flat_muon_key_names_its_new_one(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("optim:\n  name: muon\n  muon_ns_steps: 3\n")
    for argv in (["--optim.muon_momentum", "0.9"], ["-c", str(old)]):
        code, _, err = run(["fit", *argv, "--runs_dir", str(tmp_path / "runs")], capsys)
        key = "momentum" if "--optim.muon_momentum" in argv else "ns_steps"
        assert code == 2 and err.strip() == (f"normlab fit: error: optim.muon_{key} is now optim.options.{key} (with "
                                             "optim.name: muon); rename it in the config file or on the command line")
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_recording_the_flat_muon_keys_resumes_by_file(workdir):
    """A checkpoint from before `optim.options` records `optim` with the flat `muon_*` fields among its
    hyper-parameters, which LightningCLI parses on `--ckpt_path FILE`: it still resumes."""
    fit = ["fit", "-c", str(TINY), "--data.path", str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"),
           "--trainer.devices", "1", "--trainer.logger", "false", "--metrics.every_n_steps", "0",
           "--checkpoint.every_n_steps", "2"]
    with mock.patch.dict(os.environ, {DEBUG_ENV: "1"}):
        main([*fit, "--name", "old", "--trainer.max_steps", "2"])
        ckpt = workdir / "runs" / "old" / "checkpoints" / "step-00000002"
        state = torch.load(ckpt / "model.ckpt", weights_only=True)
        optim = state["hyper_parameters"]["optim"]
        del optim["options"]
        optim.update(muon_momentum=0.95, muon_nesterov=True, muon_ns_steps=5, muon_adjust_lr="match_rms_adamw")
        torch.save(state, ckpt / "model.ckpt")
        manifest = Manifest.read(ckpt)
        dataclasses.replace(manifest, files=file_sizes(ckpt), sha256=hash_files(ckpt)).write(ckpt)
        main([*fit, "--name", "old", "--trainer.max_steps", "4", "--optim.continuation", "hold", "--ckpt_path",
              str(ckpt / "model.ckpt")])
    assert (workdir / "runs" / "old" / "checkpoints" / "step-00000004" / "manifest.json").is_file()

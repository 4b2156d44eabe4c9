"""What a user sees: every line `normlab` prints is normlab's own (its logger's `[HH:MM:SS name] ...` lines, the
progress bar, a command's result) or in the short allow-list below, so a new third-party warning fails here
rather than reaching a user's console. The runs are real subprocesses, as from a shell.

A file named `srun` on the PATH is what makes Lightning print its Slurm hint (it looks the command up with
`shutil.which`, nothing more): these runs take the same path as a cluster login node.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO, run_normlab

TINY = REPO / "tests" / "helpers" / "tiny.yaml"
NORMLAB_LINE = re.compile(r"^\[\d\d:\d\d:\d\d [\w.]+\] ")  # training/cli.py's log format
PROGRESS_BAR = re.compile(r"^(Training|Validation|Testing) +━")  # the step-counting Rich bar (callbacks/progress.py)
ALLOWED = [re.compile(p) for p in (
    # Lightning's start-up report: the seed, whether an accelerator was found and used — about the user's config.
    r"^(\[rank: \d+\] )?Seed set to \d+$",
    r"^GPU available: (True|False).*, used: (True|False)$",
    r"^TPU available: ",
    # One line per rank under DeepSpeed: every rank joined the job.
    r"^initializing deepspeed distributed: GLOBAL_RANK: \d+, MEMBER: \d+/\d+$",
    # Why training ended (max_steps reached), as Lightning says it.
    r"^`Trainer\.fit` stopped: `max_steps=\d+` reached\.$",
    # Hugging Face's progress bar while export writes the weights: long for a large model, so worth its line.
    r"^Writing model shards: ",
)]


def stray_lines(output: str, *results: str) -> list[str]:
    """The lines of `output` that are neither normlab's own nor allowed; `results`: regexes of the command's own
    result lines (what evaluate or generate prints to stdout)."""
    allowed = [*ALLOWED, *(re.compile(r) for r in results)]
    lines = [line.rstrip() for chunk in output.splitlines() for line in chunk.split("\r")]
    return [line for line in lines if line.strip() and not NORMLAB_LINE.match(line)
            and not PROGRESS_BAR.match(line) and not any(p.search(line) for p in allowed)]


def console(args: list[str], cwd: Path, srun_dir: Path) -> str:
    """`normlab <args>` with `srun` on the PATH and a wide terminal (one line per progress bar)."""
    proc = run_normlab(args, cwd=cwd, PATH=os.pathsep.join([str(srun_dir), os.environ["PATH"]]), COLUMNS="200")
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def srun_dir(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    return bin_dir


def fit_args(workdir: Path, name: str, *extra: str) -> list[str]:
    """tiny.yaml with the console a user gets by default: progress bar and model summary on."""
    return ["fit", "-c", str(TINY), "--data.path", str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"),
            "--name", name, "--trainer.enable_progress_bar", "true", "--trainer.enable_model_summary", "true",
            *extra]


@pytest.fixture(scope="module")
def plain_fit(workdir, srun_dir) -> tuple[Path, str]:
    # (train-loss lines every 4 updates: the default 20 prints none in tiny.yaml's 8)
    return workdir / "runs" / "plain", console(fit_args(workdir, "plain", "--console.every_n_steps", "4"), workdir,
                                               srun_dir)


def test_fit_prints_only_normlab_lines(plain_fit):
    _, output = plain_fit
    assert stray_lines(output) == [], output
    assert any(PROGRESS_BAR.match(line) for line in output.splitlines()), output  # the bar was on


LOSS_LINE = re.compile(r"\[\d\d:\d\d:\d\d training\.callbacks\.console_log\] step (\d+)/8: (.+)$")


def test_the_log_shows_the_losses_tensorboard_holds(plain_fit):
    """A log that is no terminal (this run's output is a pipe) gets the train loss every `console.every_n_steps`
    updates and each validation's loss, as log lines holding the values TensorBoard logged at those steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, output = plain_fit
    printed = []
    for match in filter(None, map(LOSS_LINE.search, output.replace("\r", "\n").splitlines())):
        printed += [(tag, int(match.group(1)), float(value))
                    for tag, value in (part.split() for part in match.group(2).split(" · "))]
    assert [(tag, step) for tag, step, _ in printed] == [("train/loss", 4), ("val/loss", 4), ("train/loss", 8),
                                                         ("val/loss", 8)], output
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {(tag, e.step): e.value for tag in ("train/loss", "val/loss") for e in acc.Scalars(tag)}
    assert [value for *_, value in printed] == [pytest.approx(logged[tag, step], abs=5e-5)
                                                for tag, step, _ in printed]


def test_the_srun_on_path_is_seen(srun_dir, monkeypatch):
    """The fake `srun` does reach Lightning's check (else the tests here prove nothing about its hint)."""
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment

    monkeypatch.setenv("PATH", os.pathsep.join([str(srun_dir), os.environ["PATH"]]))
    with pytest.warns(UserWarning, match="The `srun` command is available on your system but is not used"):
        SLURMEnvironment._validate_srun_used()


def test_model_summary_shows_parameters_and_norm_axes(plain_fit):
    _, output = plain_fit
    assert "FLOPs" not in output and "Non-trainable" not in output  # Lightning's table, with its zero columns
    summary = [line for line in output.splitlines() if "training.callbacks.summary]" in line]
    text = "\n".join(summary)
    assert "model: 53.4 K parameters — embedding 10.2 K, attention 8.2 K, MLP 24.6 K, norms 160, head 10.2 K" in text
    for axis in ("norm rmsnorm", "placement pre", "QK-norm none", "final norm yes", "init normal"):
        assert axis in text
    assert not re.search(r"(?<![\d.])0(?![\d.])", text.split("run directory")[0]), text  # no count reads 0


def test_the_last_lines_say_where_the_run_went_and_what_comes_next(plain_fit):
    run, output = plain_fit
    lines = [line for line in output.splitlines() if line.strip()]
    tail = "\n".join(lines[-5:])
    last = run / "checkpoints" / "step-00000008"
    for expected in (f"run directory: {run}", f"checkpoints:   {run / 'checkpoints'}/ (2: step-00000004 … "
                     "step-00000008)", f"tensorboard --logdir {run}", f"normlab evaluate --checkpoint {last}",
                     f"normlab fit -c {run / 'config.yaml'} --ckpt_path last --trainer.max_steps 16"):
        assert expected in tail, tail


@pytest.mark.parametrize("command", [pytest.param("validate", marks=pytest.mark.slow), "evaluate", "generate",
                                     pytest.param("export", marks=pytest.mark.slow)])
def test_other_commands_print_only_normlab_lines(command, plain_fit, workdir, srun_dir, tmp_path):
    run, _ = plain_fit
    ckpt = str(run / "checkpoints" / "step-00000008")
    args, results = {
        # which checkpoint was loaded, then Lightning's table of the results (box-drawing lines)
        "validate": (["validate", "-c", str(run / "config.yaml"), "--ckpt_path", "last"],
                     (r"^Restoring states from the checkpoint path at ",
                      r"^Loaded model weights from the checkpoint at ", r"^[┏┃┡│└]")),
        "evaluate": (["evaluate", "--checkpoint", ckpt], (r"^step 8: val loss ",)),
        "generate": (["generate", "--checkpoint", ckpt, "--prompt", "the cat", "--max_new_tokens", "4",
                      "--temperature", "0"], (r"^the cat",)),
        "export": (["export", "--checkpoint", ckpt, "--output", str(tmp_path / "hf")], (r"^exported ",)),
    }[command]
    assert stray_lines(console(args, workdir, srun_dir), *results) == []


@pytest.mark.slow
def test_two_rank_zero2_fit_prints_only_normlab_lines(workdir, srun_dir):
    """Two ranks under DeepSpeed (Lightning's launcher re-runs the command for rank 1): the same console, and the
    summary and closing lines once, from rank 0."""
    output = console(fit_args(workdir, "zero2", "--trainer.strategy", "zero2", "--trainer.devices", "2"), workdir,
                     srun_dir)
    assert stray_lines(output) == [], output
    assert output.count("] model: ") == 1 and output.count("] run directory: ") == 1, output


def test_stray_lines_catches_a_third_party_line():
    output = ("[04:24:03 training.callbacks.throughput] MFU ...\n"
              "/site-packages/lightning/pytorch/utilities/data.py:123: Your `IterableDataset` has `__len__`\n")
    assert stray_lines(output) == ["/site-packages/lightning/pytorch/utilities/data.py:123: Your `IterableDataset` "
                                   "has `__len__`"]


def test_filters_are_scoped_and_debug_shows_everything(monkeypatch):
    """Each filter names a category and the emitting module (never a blanket ignore); NORMLAB_DEBUG=1 adds none."""
    import warnings

    from training.console import WARNINGS, quiet_third_party
    from training.errors import DEBUG_ENV

    with warnings.catch_warnings():
        warnings.resetwarnings()  # (earlier in-process commands of this test session installed the filters)
        monkeypatch.setenv(DEBUG_ENV, "1")
        quiet_third_party()
        assert not any(f[0] == "ignore" and f[3] is not None and "lightning" in f[3].pattern for f in warnings.filters)
        monkeypatch.delenv(DEBUG_ENV)
        quiet_third_party()
        ours = [f for f in warnings.filters if f[0] == "ignore" and f[3] is not None and f[1] is not None
                and f[3].pattern.startswith(("lightning", "torch"))]
        assert len(ours) == len(WARNINGS) and all(f[2] is not Warning for f in ours)


def test_closing_lines_continue_a_stopped_run_as_it_is(tmp_path):
    """A run stopped before max_steps (a signal, a time limit) resumes with its own max_steps; a finished one is
    told to raise it; a run without a complete checkpoint has nothing to evaluate."""
    from training.callbacks.summary import closing_lines
    from training.run import layout

    run = tmp_path / "run"
    assert not any("evaluate" in line or "checkpoints:" in line for line in closing_lines(run, "c.yaml", 0, 300))
    ckpt = layout.checkpoints_dir(run) / layout.step_dirname(100)
    ckpt.mkdir(parents=True)
    (ckpt / layout.MANIFEST).write_text('{"step": 100, "format": "lightning"}')
    stopped, finished = closing_lines(run, "c.yaml", 150, 300), closing_lines(run, "c.yaml", 300, 300)
    assert stopped[-1].endswith("normlab fit -c c.yaml --ckpt_path last")
    assert finished[-1].endswith("--ckpt_path last --trainer.max_steps 600 --optim.continuation hold")
    assert f"normlab evaluate --checkpoint {ckpt}" in stopped[-2]


def test_closing_lines_quote_every_path_they_print(tmp_path):
    """A run name with `$(…)`, `;` or spaces is printed so that pasting the line runs only the command it shows."""
    import shlex

    from training.callbacks.summary import closing_lines
    from training.run import layout

    run = tmp_path / "a b;$(touch x)"
    ckpt = layout.checkpoints_dir(run) / layout.step_dirname(4)
    ckpt.mkdir(parents=True)
    (ckpt / layout.MANIFEST).write_text('{"step": 4, "format": "lightning"}')
    lines = closing_lines(run, run / "config.yaml", 4, 4)
    commands = {line.split(":", 1)[0]: shlex.split(line.split(":", 1)[1]) for line in lines[2:]}
    assert commands["curves"] == ["tensorboard", "--logdir", str(run)]
    assert commands["evaluate"] == ["normlab", "evaluate", "--checkpoint", str(ckpt)]
    assert commands["train on"] == ["normlab", "fit", "-c", str(run / "config.yaml"), "--ckpt_path", "last",
                                    "--trainer.max_steps", "8", "--optim.continuation", "hold"]


# ModelConfig fields the summary's first three lines cover, and those it leaves to config.yaml. With MORE_AXES
# (the `also:` line) they must be every field, so a new field is a deliberate choice here.
SHOWN = {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "mlp", "max_seq_len", "tie_embeddings",
         "norm", "norm_eps", "placement", "qk_norm", "final_norm", "init", "init_std", "branch_scale_init",
         "dyt_alpha"}
NOT_SHOWN = {"head_dim", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_seq_len", "bias", "norm_offset", "norm_cast", "kernels", "logit_softcap",
             "attn_softcap", "parametrization", "mup_base_width", "mup_base_head_dim"}


def test_the_summary_names_the_newer_axes_only_when_they_are_set():
    import dataclasses

    from model import ModelConfig, Transformer
    from training.callbacks.summary import MORE_AXES, summary_lines

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert SHOWN | NOT_SHOWN | set(MORE_AXES) == fields and not (SHOWN | NOT_SHOWN) & set(MORE_AXES)
    tiny = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4)
    assert len(summary_lines(Transformer(ModelConfig(**tiny)), ModelConfig(**tiny))) == 3
    cfg = ModelConfig(**tiny, residual_scale="deepnorm", branch_scale="scalar", attn_sink="learnable",
                      norm="dyt", dyt_alpha={"attn": 0.8, "mlp": 0.2, "final": 0.2})
    lines = summary_lines(Transformer(cfg), cfg)
    assert lines[3] == ("also: residual_scale deepnorm · branch_scale scalar (init 0) · attn_sink learnable · "
                        "dyt_alpha {'attn': 0.8, 'mlp': 0.2, 'final': 0.2}")
    assert "scalars 12" in lines[0]  # 4 branch scales and 2 × 4 sink logits, not counted as attention or MLP


def test_several_processes_say_the_world_size_and_global_batch(tmp_path, caplog):
    """`--trainer.devices 2` on a CPU trains two-process DDP: the start says so, with the tokens per step it makes
    (here 2 ranks × 4 sequences × 2 micro-batches × 16 tokens); one process says nothing."""
    import logging

    from lightning.pytorch import Trainer

    from data.datamodule import TokenDataModule
    from training.callbacks.summary import log_world_line

    data = TokenDataModule(path=str(tmp_path / "data"), seq_len=16, batch_size=4)
    with caplog.at_level(logging.INFO, logger="training.callbacks.summary"):
        for devices in (1, 2):
            trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                              accumulate_grad_batches=2, logger=False, enable_progress_bar=False)
            log_world_line(trainer, data)
    lines = [r.getMessage() for r in caplog.records if r.name == "training.callbacks.summary"]
    assert lines == ["world size 2 (1 node × 2 processes): global batch 16 sequences, 256 tokens per step "
                     "(batch_size 4 × accumulate_grad_batches 2 × 2 ranks)"]

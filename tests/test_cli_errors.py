"""Bad input to every `normlab` command: one error line naming the value and the fix, exit status 2, no traceback,
nothing written (docs/errors.md). In-process through `training.cli.main` — the console script's own entry point —
plus one real subprocess to see what a shell sees."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

# Imported here, not first in a test: Lightning binds its log handler to the stderr of import time, which a test's
# capsys would close.
import lightning.pytorch  # noqa: F401
import pytest
import torch

from model import ModelConfig, Transformer
from tests.helpers.multiproc import REPO
from training.cli import COMMANDS, main
from training.errors import DEBUG_ENV, UserError
from training.run import layout
from training.subcommands import LIGHTNING_SUBCOMMANDS

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

TINY = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "4", "--data.seq_len", "16",
        "--data.batch_size", "2", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu"]


@pytest.fixture(scope="module")
def state_dict_file(tmp_path_factory) -> Path:
    """A tiny model as a state-dict file with its model_config.json beside it (a format every command loads)."""
    root = tmp_path_factory.mktemp("model")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=16)
    torch.save(Transformer(cfg).state_dict(), root / "model.pt")
    (root / layout.MODEL_CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    return root / "model.pt"


def taken_run(runs: Path) -> None:
    ckpt = layout.checkpoints_dir(runs / "taken") / layout.step_dirname(10)
    ckpt.mkdir(parents=True)
    (ckpt / layout.MANIFEST).write_text(json.dumps({"step": 10, "format": "lightning"}))


def logged_run(runs: Path) -> None:
    """What a fit that stopped before its first checkpoint leaves: its config and TensorBoard events."""
    (runs / "logged").mkdir(parents=True)
    (runs / "logged" / layout.CONFIG_FILE).write_text("optim:\n  lr: 0.001\n")
    (runs / "logged" / "events.out.tfevents.1.host.1.0").write_bytes(b"\0" * 24)  # (its version record, at once)


def trunk_run(runs: Path) -> None:
    """Checkpoint directories to branch from (`--branch_from`): step 4 of another model (dim 64), step 6 of this
    one, and step 2 interrupted (no manifest). The weights file is never read: the checks refuse first."""
    ckpts = layout.checkpoints_dir(runs / "trunk")
    for step, dim in ((4, 64), (6, 32)):
        ckpt = ckpts / layout.step_dirname(step)
        ckpt.mkdir(parents=True)
        cfg = ModelConfig.preset("llama", vocab_size=320, dim=dim, n_layers=1, n_heads=4, max_seq_len=16)
        (ckpt / layout.MODEL_CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
        (ckpt / layout.LIGHTNING_FILE).write_bytes(b"")
        (ckpt / layout.MANIFEST).write_text(json.dumps({"step": step, "format": "lightning"}))
    (ckpts / layout.step_dirname(2)).mkdir()


TRUNK = "{runs}/trunk/checkpoints/step-0000000"
# (command line with {data}, {runs}, {model}, {out} filled in; substrings the error line must hold)
CASES = {
    "heads_do_not_divide_dim": ("fit --model.dim 100 --model.n_heads 3", ["ModelConfig.dim=100", "n_heads=3"]),
    "negative_lr": ("fit --optim.lr -1", ["lr=-1", "lr > 0"]),
    "zero_batch": ("fit --data.batch_size 0", ["batch_size must be at least 1, got 0"]),
    "negative_max_steps": ("fit --trainer.max_steps -3", ["max_steps", "-3"]),
    "not_a_number": ("fit --model.dim abc", ["model.dim", "abc"]),
    "unknown_flag": ("fit --model.dimm 3", ["--model.dimm is not an option of normlab fit: did you mean --model.dim?"]),
    "mistyped_flag": ("fit --model.placment post", ["--model.placment is not an option of normlab fit: did you mean "
                                                    "--model.placement?", "normlab fit --help"]),
    "flag_without_its_group": ("fit --max-steps 3", ["--max-steps is not an option",
                                                     "did you mean --trainer.max_steps?"]),
    "mistyped_key_in_a_config_file": ("fit -c {runs}/typo.yaml", ["-c ", "typo.yaml: model.placment is not an "
                                                                  "option of normlab fit: did you mean "
                                                                  "model.placement?"]),
    "missing_data": ("fit --data.path {runs}/nothing-here", ["no prepared data at", "normlab prepare"]),
    "run_has_checkpoints": ("fit --name taken", ["already holds checkpoints", "--ckpt_path last"]),
    "run_logged_without_checkpoints": ("fit --name logged", ["logged already holds a run (config.yaml, TensorBoard "
                                                             "events; no complete checkpoint)", "--ckpt_path last",
                                                             "--name <new name>"]),
    "name_leaves_runs_dir": ("fit --name ../escaped", ["--name '../escaped'", "inside --runs_dir", "`..`"]),
    "absolute_name": ("fit --name {runs}/abs", ["/abs': a run's name is a path inside --runs_dir", "not absolute"]),
    "name_too_long": ("fit --name lr/" + "x" * 300, ["300 bytes long", "at most 100"]),
    "name_through_a_link_out": ("fit --name away/run", ["away is a link to", "elsewhere, outside --runs_dir"]),
    "missing_ckpt_path": ("fit --ckpt_path {runs}/no-such-step", ["no such checkpoint"]),
    "missing_branch_from": ("fit --name cool --branch_from {runs}/no-such-step",
                            ["--branch_from", "no-such-step: no such checkpoint", "step-XXXXXXXX"]),
    "incomplete_branch_from": (f"fit --name cool --branch_from {TRUNK}2",
                               ["--branch_from", "step-00000002: no manifest.json", "an interrupted save"]),
    "branch_from_another_model": (f"fit --name cool --branch_from {TRUNK}4",
                                  ["cannot branch from", "step-00000004", "(dim: 64 → 32, head_dim: 16 → 8)",
                                   "model_config.json"]),
    "branch_from_and_ckpt_path": (f"fit --name cool --branch_from {TRUNK}6 --ckpt_path {TRUNK}4",
                                  ["--branch_from", "--ckpt_path", "give one of them", "--ckpt_path last"]),
    "branch_into_a_run_with_checkpoints": (f"fit --name taken --branch_from {TRUNK}6",
                                           ["taken already holds checkpoints", "--name"]),
    "branch_from_outside_fit": (f"validate --branch_from {TRUNK}6", ["--branch_from applies to `normlab fit`"]),
    "branch_ends_before_it_starts": (f"fit --name cool --branch_from {TRUNK}6",
                                     ["--trainer.max_steps 1", "parent's step 6", "larger max_steps"]),
    "unwritable_export": ("export --checkpoint {model} --format safetensors --output {runs}/a-file/model",
                          ["cannot write --output", "a-file/model", "choose a directory"]),
    "top_p_above_one": ("generate --checkpoint {model} --prompt hi --top_p 1.5", ["--top_p 1.5", "(0, 1]"]),
    "negative_temperature": ("generate --checkpoint {model} --prompt hi --temperature -1",
                             ["--temperature -1.0", ">= 0"]),
    "zero_top_k": ("generate --checkpoint {model} --prompt hi --top_k 0", ["--top_k 0", "at least 1"]),
    "no_new_tokens": ("generate --checkpoint {model} --prompt hi --max_new_tokens 0", ["--max_new_tokens 0"]),
    "missing_checkpoint": ("evaluate --checkpoint {runs}/nope", ["'", "nope' does not exist"]),
}


def argv_of(line: str, workdir: Path, runs: Path, model: Path) -> list[str]:
    argv = line.format(runs=runs, model=model).split()
    if argv[0] == "fit":
        has_data = any(a == "--data.path" for a in argv)
        argv[1:1] = [*TINY, "--runs_dir", str(runs), *([] if has_data else ["--data.path", str(workdir / "tiny")])]
    return argv


def files_under(path: Path) -> set[Path]:
    return set(path.rglob("*"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_error_is_one_line(case, workdir, tmp_path, state_dict_file, capsys, lightning_to_capsys, monkeypatch):
    """The error line is all a refused fit, validate or test prints: no start-up line (Lightning's seed, the
    accelerators found, a config warning) before it."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    line, expected = CASES[case]
    runs = tmp_path / "runs"
    taken_run(runs)
    logged_run(runs)
    trunk_run(runs)
    (runs / "a-file").write_text("not a directory")
    (tmp_path / "elsewhere").mkdir()
    (runs / "away").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # a link out of --runs_dir
    (runs / "typo.yaml").write_text("model:\n  placment: post\n")
    before = files_under(tmp_path)
    code = main(argv_of(line, workdir, runs, state_dict_file))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    command = line.split()[0]
    assert code == 2, err
    assert lines and lines[-1].startswith(f"normlab {command}: error: "), err
    if command in LIGHTNING_SUBCOMMANDS:  # (a plain command may say what it loaded before it refuses)
        assert len(lines) == 1, err
    assert "Traceback" not in err and out == "", err
    for part in expected:
        assert part in lines[-1], lines[-1]
    assert files_under(tmp_path) == before  # no partial output: no run directory, no temporary export


def help_flags(command: str, capsys) -> list[str]:
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    return sorted(set(re.findall(r"(?<![\w-])--[a-z][\w-]*", capsys.readouterr().out)) - {"--help"})


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_one_flag_style_and_the_old_spelling_names_the_new_one(command, capsys):
    """Every plain command spells its flags as `fit` does (LightingCLI's underscores); the hyphenated spelling
    they had before is one error line naming the new one, whether given as `--a-b v` or `--a-b=v`."""
    flags = help_flags(command, capsys)
    assert flags and not [f for f in flags if "-" in f[2:]], flags
    for flag in (f for f in flags if "_" in f):
        old = flag.replace("_", "-")
        for argv in ([command, old, "1"], [command, f"{old}=1"]):
            assert main(argv) == 2
            assert capsys.readouterr().err == (f"normlab {command}: error: {old}: normlab's flags are spelled with "
                                               f"underscores (as `normlab fit`'s are): use {flag}\n")


def test_a_hyphenated_value_is_not_a_flag(state_dict_file, capsys):
    """A value with a space is a value to argparse, however it starts: the check leaves it alone (the command gets
    as far as loading the model, which has no tokenizer)."""
    assert main(["generate", "--checkpoint", str(state_dict_file), "--prompt", "--not-a flag"]) == 2
    assert "error: no tokenizer found" in capsys.readouterr().err


def test_debug_shows_the_traceback_and_bugs_keep_theirs(workdir, tmp_path, state_dict_file, monkeypatch):
    argv = ["generate", "--checkpoint", str(state_dict_file), "--prompt", "hi", "--top_p", "1.5"]
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(UserError, match="--top_p 1.5"):
        main(argv)
    monkeypatch.delenv(DEBUG_ENV)

    def bug(*args, **kwargs):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr("training.generate.load_checkpoint", bug)  # stands in for a bug past the checks
    with pytest.raises(KeyError, match="a bug"):
        main(argv[:-2])


@pytest.mark.parametrize("command, target", [("evaluate", "training.eval.cli.evaluate_sets"),
                                             ("export", "training.export.load_checkpoint")])
def test_a_library_valueerror_keeps_its_traceback(command, target, state_dict_file, tmp_path, monkeypatch):
    """A ValueError from a library (torch, lm-eval, a bug of normlab's) is not bad input: no command catches it to
    print it as one line, so it reaches the caller with its traceback."""
    def bug(*args, **kwargs):
        raise ValueError("a library's ValueError, not bad input")

    monkeypatch.setattr(target, bug)
    with pytest.raises(ValueError, match="a library's ValueError"):
        main([command, "--checkpoint", str(state_dict_file), "--output", str(tmp_path / "out")])


def test_only_the_entry_points_print_user_errors():
    """One error path: commands raise UserError, and only `normlab` itself (training/cli.py) — and the Slurm array
    task, an entry point of its own — print it."""
    printing = sorted(str(p.relative_to(REPO)) for p in (REPO / "training").rglob("*.py")
                      if "report_user_error(" in p.read_text() and p.name != "errors.py")
    assert printing == ["training/cli.py", "training/sweep/slurm.py"]


def test_a_shell_sees_one_line(workdir, tmp_path):
    """The console script as a shell runs it: exit status 2 and the one line (no traceback) on stderr."""
    argv = argv_of(CASES["negative_lr"][0], workdir, tmp_path / "runs", tmp_path / "unused")
    proc = subprocess.run([sys.executable, "-m", "training.cli", *argv], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("normlab fit: error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""

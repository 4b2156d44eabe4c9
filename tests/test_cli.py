"""The `normlab` command line: dispatch, LightningCLI parsing, configs and errors (in-process, no training)."""
from __future__ import annotations

import importlib
import json
import subprocess

import pytest
import yaml

from model import ModelConfig
from training import checkpoint
from training.cli import COMMANDS, main
from training.lit_module import RUNTIME_ARGS
from tests.helpers.multiproc import REPO

# In-process calls pass argv explicitly while pytest's own argv is set; that is what LightningCLI warns about.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def print_config(argv, capsys) -> dict:
    code, out, err = run(["fit", *argv, "--print_config"], capsys)
    assert code in (0, None), err
    return yaml.safe_load(out)


def test_usage_and_unknown_command(capsys):
    code, out, _ = run([], capsys)
    assert code == 2 and "fit" in out and "prepare" in out
    code, _, err = run(["fitt"], capsys)
    assert code == 2 and "unknown command 'fitt'" in err


def test_fit_help(capsys):
    code, out, _ = run(["fit", "--help"], capsys)
    assert code == 0
    for flag in ("--model.placement", "--optim.lr", "--data.path", "--trainer.strategy", "--ckpt_path",
                 "--checkpoint.every_n_steps", "--name"):
        assert flag in out


def test_prepare_is_dispatched(capsys):
    code, out, _ = run(["prepare", "--help"], capsys)
    assert code == 0 and "--output" in out


def test_print_config_with_dotted_overrides(capsys):
    config = print_config(["--model.placement", "post", "--trainer.max_steps", "100", "--optim.lr", "3e-4",
                           "--trainer.strategy", "zero3"], capsys)
    assert config["model"]["placement"] == "post" and config["model"]["preset"] == "llama"
    assert config["trainer"]["max_steps"] == 100 and config["optim"]["lr"] == 3e-4
    assert config["trainer"]["strategy"] == "zero3"


def test_research_options_reach_the_config(capsys):
    config = print_config(["--model.norm", "dyt", "--model.dyt_alpha", "0.2", "--model.mlp", "relu",
                           "--model.init", "xavier", "--model.logit_softcap", "30", "--model.attn_softcap", "50",
                           "--optim.z_loss", "1e-4", "--optim.schedule", "wsd", "--optim.decay_shape", "1-sqrt",
                           "--optim.decay_fraction", "0.1"], capsys)
    cfg = _resolved_model(config)
    assert (cfg.norm, cfg.dyt_alpha, cfg.mlp, cfg.init) == ("dyt", 0.2, "relu", "xavier")
    assert (cfg.logit_softcap, cfg.attn_softcap) == (30, 50)
    assert config["optim"]["z_loss"] == 1e-4 and config["optim"]["decay_shape"] == "1-sqrt"
    assert config["optim"]["schedule"] == "wsd" and config["optim"]["decay_fraction"] == 0.1


def _resolved_model(config: dict) -> ModelConfig:
    fields = {k: v for k, v in config["model"].items() if v is not None and k not in RUNTIME_ARGS}
    fields.setdefault("vocab_size", 8192)  # the default corpus's tokenizer
    fields.setdefault("max_seq_len", config["data"]["seq_len"])
    return ModelConfig.preset(config["model"]["preset"], **fields)


def test_default_yaml_is_the_builtin_default(capsys):
    """configs/default.yaml spells out what `normlab fit` does with no arguments: the two must not drift."""
    builtin = print_config([], capsys)
    from_file = print_config(["-c", str(REPO / "configs" / "default.yaml")], capsys)
    assert _resolved_model(builtin) == _resolved_model(from_file)
    assert 7e6 < _resolved_model(builtin).num_params() < 9e6  # the "~8M-parameter" default model
    for config in (builtin, from_file):
        config.pop("model"), config.pop("config", None)
    assert builtin == from_file


@pytest.mark.parametrize("recipe", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses(recipe, capsys):
    print_config(["-c", str(recipe)], capsys)


@pytest.mark.parametrize("yaml_text, key", [
    ("model:\n  dimm: 32\n", "dimm"),
    ("trainr:\n  max_steps: 3\n", "trainr"),
    ("optim:\n  lrr: 0.1\n", "lrr"),
])
def test_unknown_yaml_key_is_a_clear_error(tmp_path, capsys, yaml_text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    code, _, err = run(["fit", "-c", str(path), "--print_config"], capsys)
    assert code == 2 and f"'{key}" in err and ("not accepted" in err or "does not accept" in err), err


def test_bad_model_value_fails_before_training(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"placement='middle'.*\['pre', 'post'"):
        main(["fit", "--model.placement", "middle", "--runs_dir", str(tmp_path)])


def test_fresh_fit_refuses_a_run_with_checkpoints(tmp_path):
    ckpt = checkpoint.checkpoints_dir(tmp_path / "taken") / checkpoint.step_dirname(10)
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps({"step": 10, "format": "lightning"}))
    with pytest.raises(FileExistsError, match="--ckpt_path last"):
        main(["fit", "--runs_dir", str(tmp_path), "--name", "taken"])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_resolves(command):
    module, function = COMMANDS[command][0].split(":")
    assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.parametrize("script", ["launch_deepspeed.sh", "launch_torchrun.sh", "slurm.sbatch"])
def test_launcher_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / script)]).returncode == 0

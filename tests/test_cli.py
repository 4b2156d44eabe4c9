"""The `normlab` command line: dispatch, LightningCLI parsing, configs and errors (in-process, no training)."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import subprocess
import sys

import pytest
import yaml

from model import ModelConfig
from tests.helpers.multiproc import REPO
from training.cli import COMMANDS, main

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


def test_the_default_job_is_configs_default_yaml(capsys):
    """`normlab fit` with no arguments runs configs/default.yaml (its default config file): the ~8M-parameter
    model, and the model group offers every ModelConfig field (read from the dataclass)."""
    config = print_config([], capsys)
    assert config["trainer"]["max_steps"] == yaml.safe_load((REPO / "configs" / "default.yaml").read_text())[
        "trainer"]["max_steps"]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(config["model"]) == fields | {"preset", "compile", "activation_checkpointing"}
    model = {k: v for k, v in config["model"].items() if k in fields and v is not None}
    model = ModelConfig.preset(config["model"]["preset"], **{"vocab_size": 8192,  # the default corpus's tokenizer
                                                             "max_seq_len": config["data"]["seq_len"], **model})
    assert 7e6 < model.num_params() < 9e6


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


STREAM_FLAGS = {  # (field, command-line text, parsed value): every stream field at once, then the unions' numbers
    "words": [("norm", "derf", "derf"), ("dyt_alpha", "{attn: 0.8, mlp: 0.2, final: 0.2}",
                                         {"attn": 0.8, "mlp": 0.2, "final": 0.2}),
              ("residual_scale", "deepnorm", "deepnorm"), ("branch_scale", "vector", "vector"),
              ("branch_scale_init", "1e-5", 1e-5), ("norm_depth_scale", "true", True),
              ("placement_mlp", "none", "none"), ("mix_ln", "0.25", 0.25), ("embed_norm", "true", True),
              ("embed_scale", "sqrt_dim", "sqrt_dim"),
              ("norm_affine", "false", False)],
    "numbers": [("residual_scale", "1.5", 1.5), ("embed_scale", "3", 3.0), ("dyt_alpha", "0.3", 0.3),
                ("norm", "rmsnorm_scalar", "rmsnorm_scalar")],
}


@pytest.mark.parametrize("fields", STREAM_FLAGS.values(), ids=STREAM_FLAGS)
def test_stream_fields_parse_from_the_command_line(fields, capsys):
    cfg = _resolved_model(print_config([a for f, text, _ in fields for a in (f"--model.{f}", text)], capsys))
    for field, _, want in fields:
        assert getattr(cfg, field) == want and type(getattr(cfg, field)) is type(want), field


def _resolved_model(config: dict) -> ModelConfig:
    runtime = ("preset", "compile", "activation_checkpointing")
    fields = {k: v for k, v in config["model"].items() if v is not None and k not in runtime}
    fields.setdefault("vocab_size", 8192)  # the default corpus's tokenizer
    fields.setdefault("max_seq_len", config["data"]["seq_len"])
    return ModelConfig.preset(config["model"]["preset"], **fields)


# configs/sweeps/ holds sweep specs, not fit recipes (tests/test_sweep.py parses them)
RECIPES = sorted([*(p for p in (REPO / "configs").rglob("*.yaml") if "sweeps" not in p.parts),
                  *(REPO / "tests" / "helpers").glob("*.yaml")])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses(recipe, capsys):
    print_config(["-c", str(recipe)], capsys)


@pytest.mark.parametrize("yaml_text, key, nearest", [
    ("model:\n  dimm: 32\n", "model.dimm", "model.dim"),
    ("trainr:\n  max_steps: 3\n", "trainr.max_steps", "trainer.max_steps"),
    ("optim:\n  lrr: 0.1\n", "optim.lrr", "optim.lr"),
])
def test_unknown_yaml_key_is_a_clear_error(tmp_path, capsys, yaml_text, key, nearest):
    """A mistyped key of a -c file: the line names the file, the whole key and the nearest option."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    code, _, err = run(["fit", "-c", str(path), "--print_config"], capsys)
    assert code == 2 and err == (f"normlab fit: error: -c {path}: {key} is not an option of normlab fit: did you "
                                 f"mean {nearest}? (normlab fit --help lists the options)\n"), err


def test_bad_model_value_fails_before_training(tmp_path, capsys):
    code, _, err = run(["fit", "--model.placement", "middle", "--runs_dir", str(tmp_path)], capsys)
    assert code == 2 and not any(tmp_path.iterdir())
    assert re.search(r"normlab fit: error: .*placement='middle'.*\['pre', 'post'", err), err


def test_a_bad_config_file_is_refused_before_lightning_is_imported(tmp_path):
    """A `-c` file that is no YAML mapping needs no parser to refuse: one line, in a process that never imported
    Lightning (its imports are most of a refused start's seconds)."""
    bad = tmp_path / "list.yaml"
    bad.write_text("- lr: 0.1\n")
    probe = ("import sys; from training.cli import main; code = main(['fit', '-c', sys.argv[1]]); "
             "print(code, 'lightning' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, str(bad)], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stdout + proc.stderr
    assert proc.stderr == f"normlab fit: error: -c {bad}: holds a YAML list, not a mapping of config groups (e.g. " \
                          "`optim: {lr: 0.001}`)\n"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_resolves(command):
    module, function = COMMANDS[command][0].split(":")
    assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.parametrize("script", ["launch_deepspeed.sh", "launch_torchrun.sh", "slurm.sbatch"])
def test_launcher_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / script)]).returncode == 0


def no_training(monkeypatch) -> list:
    """Replace Trainer.fit (keeping its signature, from which LightningCLI builds the subcommand) with one that
    only records the module it was given."""
    from lightning.pytorch import Trainer

    built = []

    @functools.wraps(Trainer.fit)
    def record(self, model, *args, **kwargs):
        built.append(model)

    monkeypatch.setattr(Trainer, "fit", record)
    return built


@pytest.mark.parametrize("extra, expected", [
    ([], (320, 16)),  # the tiny corpus's tokenizer pieces and data.seq_len
    (["--model.vocab_size", "384", "--model.max_seq_len", "64"], (384, 64)),  # a padded vocab, a longer RoPE table
])
def test_the_data_gives_the_model_its_vocab_and_context(workdir, tmp_path, monkeypatch, capsys, extra, expected):
    """`data.vocab_size` and `data.seq_len` reach the module through the CLI's linked arguments, as the defaults of
    the model's fields: the config is complete when the classes are built (Trainer.fit replaced: no training)."""
    built = no_training(monkeypatch)
    code, _, err = run(["fit", "--data.path", str(workdir / "tiny"), "--data.seq_len", "16",
                        "--runs_dir", str(tmp_path), *extra], capsys)
    assert code in (0, None), err
    assert (built[0].config.vocab_size, built[0].config.max_seq_len) == expected


def test_a_fresh_machine_configures_the_model_before_the_default_corpus_exists(tmp_path, monkeypatch, capsys):
    """Before its first build the default corpus reports the vocabulary it will be built with, so the model is
    configured without building anything (that happens in prepare_data, on one process per node)."""
    from data.prepare import DEFAULT_OUTPUT, DEFAULT_VOCAB_SIZE

    monkeypatch.chdir(tmp_path)
    built = no_training(monkeypatch)
    code, _, err = run(["fit", "--runs_dir", str(tmp_path / "runs")], capsys)
    assert code in (0, None), err
    assert (built[0].config.vocab_size, built[0].config.max_seq_len) == (DEFAULT_VOCAB_SIZE, 256)
    assert not (tmp_path / DEFAULT_OUTPUT).exists()

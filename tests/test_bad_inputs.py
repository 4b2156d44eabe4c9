"""Every bad input of docs/errors.md's promise, fed to its command: exit status 2, one error line naming the value
and the fix, no traceback, nothing written (no run directory, no sweep state, no export, no prepared data) — and
no code from a crafted file ever runs. The inputs are those a red-team pass tried against each command; each row
is named after what it feeds. In-process through `training.cli.main` (the console script's entry point).

Inputs normlab accepts on purpose are tested where they are documented: a warm-up longer than the run trains with
a warning (below), `--data.val_batches 0` validates nothing (tests/test_data_datamodule.py)."""
from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler at import)
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.multiproc import REPO
from tests.test_safe_loading import Payload  # unpickling it runs `touch MARKER`
from training.cli import main
from training.errors import DEBUG_ENV
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

TINY = str(REPO / "tests" / "helpers" / "tiny.yaml")
FIT = "fit -c {tiny} --data.path {data} --runs_dir {out}/runs --name bad"

# id: (command line, substrings of the error line). Placeholders: {tiny} tests/helpers/tiny.yaml, {data} the tiny
# corpus, {out} this test's own directory (where a refused command must write nothing), {bad} the crafted inputs,
# {run} a finished 2-step run, {ckpt} its checkpoint.
ROWS: dict[str, tuple[str, list[str]]] = {
    # fit: values
    "lr_nan": (f"{FIT} --optim.lr nan", ['"optim.lr"', "nan"]),
    "lr_inf": (f"{FIT} --optim.lr inf", ['"optim.lr"', "inf"]),
    "seq_len_zero": (f"{FIT} --data.seq_len 0", ["data seq_len must be at least 1, got 0"]),
    "seq_len_negative": (f"{FIT} --data.seq_len -5", ["data seq_len must be at least 1, got -5"]),
    "batch_size_negative": (f"{FIT} --data.batch_size -1", ["data batch_size must be at least 1, got -1"]),
    "val_batches_negative": (f"{FIT} --data.val_batches -1", ["val_batches must be at least 0"]),
    "clip_negative": (f"{FIT} --trainer.gradient_clip_val -1", ["--trainer.gradient_clip_val -1 must be >= 0",
                                                                "no clipping"]),
    "clip_nan": (f"{FIT} --trainer.gradient_clip_val nan", ['"trainer.gradient_clip_val"']),
    "placement_unknown": (f"{FIT} --model.placement pree", ["placement='pree' is not valid", "choose one of"]),
    "norm_unknown": (f"{FIT} --model.norm RMSNorm", ["'RMSNorm'"]),
    "final_norm_not_bool": (f"{FIT} --model.final_norm maybe", ["final_norm", "maybe"]),
    "weight_decay_nan": (f"{FIT} --optim.weight_decay nan", ['"optim.weight_decay"']),
    "weight_decay_negative": (f"{FIT} --optim.weight_decay -1", ["optim.weight_decay=-1.0 must be >= 0"]),
    "betas_out_of_range": (f"{FIT} --optim.betas [2.0,0.9]", ["optim.betas=[2.0, 0.9] must be two numbers in [0, 1)"]),
    "eps_negative": (f"{FIT} --optim.eps -1", ["optim.eps=-1.0 must be a positive number"]),
    "layers_zero": (f"{FIT} --model.n_layers 0", ["n_layers=0 must be a positive integer"]),
    "accumulate_zero": (f"{FIT} --trainer.accumulate_grad_batches 0",
                        ["--trainer.accumulate_grad_batches 0 must be an integer >= 1"]),
    "max_steps_zero": (f"{FIT} --trainer.max_steps 0", ["--trainer.max_steps 0 trains no step"]),
    "endless_schedule": (f"{FIT} --trainer.max_steps -1 --trainer.max_epochs -1",
                         ["never ends", "--optim.decay_steps"]),
    "every_n_steps_negative": (f"{FIT} --checkpoint.every_n_steps -2", ["checkpoint.every_n_steps=-2 must be >= 0"]),
    "console_every_n_steps_negative": (f"{FIT} --console.every_n_steps -1",
                                       ["console.every_n_steps=-1 must be >= 0"]),
    "min_lr_above_lr": (f"{FIT} --optim.min_lr 0.5", ["0 <= min_lr <= lr", "min_lr=0.5"]),
    "cluster_timeout_overflows": (f"{FIT} --cluster.timeout_s 1e300", ["cluster.timeout_s=1e+300 must be between 1 "
                                                                        "and 604800 seconds"]),
    "cluster_timeout_below_a_second": (f"{FIT} --cluster.timeout_s 0.0001", ["cluster.timeout_s=0.0001 must be"]),
    "devices_zero": (f"{FIT} --trainer.devices 0", ["devices"]),
    # fit: files and paths
    "config_not_utf8": (f"{FIT} -c {{bad}}/nonutf8.yaml", ["-c ", "nonutf8.yaml: not a UTF-8 text file (byte 18"]),
    "config_binary": (f"{FIT} -c {{bad}}/binary.yaml", ["binary.yaml: not a UTF-8 text file"]),
    "config_empty": (f"{FIT} -c {{bad}}/empty.yaml", ["empty.yaml: the file is empty"]),
    "config_python_tag": (f"{FIT} -c {{bad}}/pytag.yaml", ["pytag.yaml: not valid YAML", "python/object/apply"]),
    "config_alias_bomb": (f"{FIT} -c {{bad}}/bomb.yaml", ["-c ", "bomb.yaml: its YAML aliases", "100,000 values"]),
    "config_nested_too_deep": (f"{FIT} -c {{bad}}/deep.yaml", ["deep.yaml: YAML nested deeper than 64 levels"]),
    "config_names_an_alias_bomb": (f"{FIT} -c {{bad}}/names_bomb.yaml",
                                   ["bomb.yaml (named in -c ", "names_bomb.yaml): its YAML aliases"]),
    "data_path_a_file": (f"{FIT} --data.path {{bad}}/nonutf8.yaml", ["no prepared data at", "normlab prepare"]),
    "ckpt_path_a_yaml_file": (f"{FIT} --ckpt_path {{run}}/config.yaml",
                              ["config.yaml' is not a checkpoint file", "step directory"]),
    "ckpt_path_the_checkpoints_dir": (f"{FIT} --ckpt_path {{run}}/checkpoints",
                                      ["a directory that is no checkpoint", "step-00000002) or `last`"]),
    "name_leaves_runs_dir": (f"{FIT} --name ../escaped", ["--name '../escaped'", "inside --runs_dir"]),
    "wandb_without_a_key": (f"{FIT} --loggers [wandb]", ["--loggers wandb: No API key configured",
                                                          "WANDB_MODE=offline"]),
    # the other commands
    "prepare_empty_text": ("prepare --input {bad}/empty_txt --output {out}/data", ["contains no usable files"]),
    "prepare_binary_text": ("prepare --input {bad}/binary_txt --output {out}/data", ["binary.txt", "byte"]),
    "prepare_tiny_vocabulary": ("prepare --input {bad}/text --output {out}/data --vocab_size 10",
                                ["--vocab_size 10", "261"]),
    "sweep_spec_not_utf8": ("sweep {bad}/spec_nonutf8.yaml --dry_run", ["spec_nonutf8.yaml': not a UTF-8 text file"]),
    "sweep_seed_twice": ("sweep {bad}/spec_seeds.yaml --dry_run", ["seeds"]),
    "sweep_unknown_baseline": ("sweep {bad}/spec_baseline.yaml --dry_run", ["baseline", "placement=mid"]),
    "sweep_spec_alias_bomb": ("sweep {bad}/bomb.yaml --dry_run", ["sweep spec '", "bomb.yaml': its YAML aliases"]),
    "sweep_spec_a_list": ("sweep {bad}/spec_list.yaml --dry_run", ["must be a YAML mapping"]),
    "sweep_spec_a_directory": ("sweep {bad} --dry_run", ["cannot be read"]),
    "sweep_same_value_twice": ("sweep {bad}/spec_dup.yaml --dry_run", ["grid.optim.lr lists a value twice"]),
    "sweep_max_parallel_zero": ("sweep {bad}/spec_ok.yaml --max_parallel 0", ["--max_parallel 0 must be >= 1"]),
    "compare_no_config": ("compare {bad} {run} --plot {out}/c.png", ["is not a normlab run"]),
    "compare_missing_dir": ("compare {out}/nope {run} --plot {out}/c.png", ["nope"]),
    "compare_record_not_json": ("compare {bad}/record_bad {run} --group_by model.placement --plot {out}/c.png",
                                ["sweep-run.json' cannot be read"]),
    "compare_record_a_list": ("compare {bad}/record_list {run} --group_by model.placement --plot {out}/c.png",
                              ["sweep-run.json' holds a list, not a mapping"]),
    "compare_config_binary": ("compare {bad}/config_binary {run} --plot {out}/c.png",
                              ["config.yaml' cannot be read (UnicodeDecodeError"]),
    "compare_config_alias_bomb": ("compare {bad}/config_bomb {run} --plot {out}/c.png",
                                  ["config_bomb/config.yaml' cannot be read", "aliases", "expand to more than"]),
    "compare_config_not_yaml": ("compare {bad}/config_unclosed {run} --plot {out}/c.png",
                                ["config.yaml' cannot be read", "restore it"]),
    "compare_unknown_key": ("compare {run} {run} --group_by no.such.key --plot {out}/c.png",
                            ["--group_by no.such.key: no such key"]),
    "evaluate_missing_data": ("evaluate --checkpoint {ckpt} --data /nonexistent/dir", ["/nonexistent/dir"]),
    "evaluate_no_checkpoint_dir": ("evaluate --checkpoint {bad}/empty_dir", ["is not a complete checkpoint"]),
    "evaluate_a_text_file": ("evaluate --checkpoint {bad}/text.pt", ["text.pt' is not a checkpoint file"]),
    "evaluate_manifest_corrupt": ("evaluate --checkpoint {bad}/corrupt_manifest", ["corrupt manifest"]),
    "evaluate_model_file_missing": ("evaluate --checkpoint {bad}/no_model", ["'model.ckpt' is missing"]),
    "generate_temperature_nan": ("generate --checkpoint {ckpt} --prompt hi --temperature nan", ["--temperature nan"]),
    "export_onto_a_file": ("export --checkpoint {ckpt} --output {bad}/text.pt", ["--output"]),
    "export_unknown_format": ("export --checkpoint {ckpt} --output {out}/x --format gguf",
                              ["argument --format: invalid choice: 'gguf'", "normlab export --help"]),
    "coordcheck_bad_widths": ("coordcheck --widths 0 -3 --output {out}/cc", ["width 0", "ModelConfig.dim=0"]),
    "study_unknown_claim": ("study --claims 99 --output {out}/study", ["99"]),
    # a crafted Hugging Face directory: pickled weights that would run `touch MARKER`
    "generate_pickled_hf_weights": ("generate --checkpoint {bad}/hf_bin --prompt hi", ["refusing to load", "hf_bin",
                                                                                     "posix.system"]),
    "evaluate_pickled_hf_weights": ("evaluate --checkpoint {bad}/hf_bin", ["refusing to load", "posix.system"]),
    "export_pickled_hf_weights": ("export --checkpoint {bad}/hf_bin --output {out}/x", ["refusing to load"]),
    # pickle.dump, not torch.save: refused at its first opcode, so the type is read from the file's opcodes
    "evaluate_plain_pickled_hf_weights": ("evaluate --checkpoint {bad}/hf_plain", [
        "refusing to load '", "hf_plain/pytorch_model.bin': it holds posix.system, which is not a tensor"]),
    "init_from_pickled_hf_weights": (f"{FIT} --init_from {{bad}}/hf_bin", ["--init_from"]),
}


def spec(text: str) -> str:
    return ("base:\n  overrides: {model.dim: 32, model.n_layers: 1, model.n_heads: 4, trainer.max_steps: 1}\n"
            + text)


# "Billion laughs": each line lists the previous one ten times (a million values in six short lines)
BOMB = "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 6))


def craft(bad: Path, run: Path, ckpt: Path) -> None:
    """The crafted inputs, in `bad`."""
    bad.mkdir()
    (bad / "bomb.yaml").write_text(BOMB)
    (bad / "deep.yaml").write_text("model: " + "[" * 100 + "]" * 100 + "\n")
    (bad / "names_bomb.yaml").write_text("optim: bomb.yaml\n")  # a nested config file (relative to this one)
    (bad / "nonutf8.yaml").write_bytes(b"optim:\n  lr: 0.001\xff\xfe\n")
    (bad / "binary.yaml").write_bytes(bytes(range(256)))
    (bad / "empty.yaml").write_text("")
    (bad / "pytag.yaml").write_text("!!python/object/apply:os.system ['touch " + str(bad / "MARKER") + "']\n")
    for name, content in (("empty_txt/empty.txt", b""), ("binary_txt/binary.txt", b"ok \xff\xfe\x00 text"),
                          ("text/a.txt", b"the cat sat on the mat. " * 50)):
        (bad / name).parent.mkdir()
        (bad / name).write_bytes(content)
    (bad / "spec_nonutf8.yaml").write_bytes(b"name: sp\xff\n")
    (bad / "spec_seeds.yaml").write_text(spec("grid: {model.placement: [pre, post]}\nseeds: [0, 0]\n"))
    (bad / "spec_baseline.yaml").write_text(spec("grid: {model.placement: [pre, post]}\nbaseline: placement=mid\n"))
    (bad / "spec_list.yaml").write_text("- a\n- b\n")
    (bad / "spec_dup.yaml").write_text(spec("grid: {optim.lr: [1, 1.0]}\n"))
    (bad / "spec_ok.yaml").write_text(spec("grid: {model.placement: [pre, post]}\n"))
    for name, file, content in (("record_bad", "sweep-run.json", b"{bad"), ("record_list", "sweep-run.json", b"[1]"),
                                ("config_binary", "config.yaml", bytes(range(256))),
                                ("config_unclosed", "config.yaml", b"a: [unclosed\n"),
                                ("config_bomb", "config.yaml", BOMB.encode())):
        shutil.copytree(run, bad / name)
        (bad / name / file).write_bytes(content)
    (bad / "empty_dir").mkdir()
    (bad / "text.pt").write_text("not a checkpoint\n")
    shutil.copytree(ckpt, bad / "corrupt_manifest")
    (bad / "corrupt_manifest" / layout.MANIFEST).write_text("{bad")
    shutil.copytree(ckpt, bad / "no_model")
    (bad / "no_model" / layout.LIGHTNING_FILE).unlink()
    # an export's config.json beside weights pickled with a payload (transformers reads them weights-only)
    assert main(["export", "--checkpoint", str(ckpt), "--output", str(bad / "hf_bin")]) == 0
    weights = load_file(bad / "hf_bin" / "model.safetensors")
    (bad / "hf_bin" / "model.safetensors").unlink()
    torch.save({**weights, "payload": Payload(bad / "MARKER")}, bad / "hf_bin" / "pytorch_model.bin")
    shutil.copytree(bad / "hf_bin", bad / "hf_plain")
    with open(bad / "hf_plain" / "pytorch_model.bin", "wb") as f:
        pickle.dump({**weights, "payload": Payload(bad / "MARKER")}, f)


@pytest.fixture(scope="module")
def inputs(workdir) -> dict[str, Path]:
    """The placeholders' paths: a finished 2-step run (TensorBoard on) and the crafted inputs."""
    runs = workdir / "runs"
    assert main(["fit", "-c", TINY, "--data.path", str(workdir / "tiny"), "--runs_dir", str(runs), "--name", "base",
                 "--trainer.max_steps", "2", "--checkpoint.every_n_steps", "2", "--metrics.every_n_steps", "0"]) == 0
    run = runs / "base"
    ckpt = layout.checkpoints_dir(run) / layout.step_dirname(2)
    craft(workdir / "bad", run, ckpt)
    return {"tiny": Path(TINY), "data": workdir / "tiny", "bad": workdir / "bad", "run": run, "ckpt": ckpt}


def snapshot(*roots: Path) -> dict[Path, tuple[int, int] | None]:
    """Every file's size and modification time, and every directory (whose own mtime a lock file taken and
    removed again changes)."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for root in roots for p in root.rglob("*")}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_bad_input_is_one_line_and_writes_nothing(row, inputs, tmp_path, capsys, monkeypatch):
    line, expected = ROWS[row]
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: W&B has no key
    monkeypatch.chdir(tmp_path)  # a relative default output would land here, and be seen
    out = tmp_path / "out"
    out.mkdir()
    argv = line.format(out=out, **inputs).split()
    before = snapshot(tmp_path, inputs["bad"], inputs["run"])
    capsys.readouterr()
    code = main(argv)
    stdout, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert lines and lines[-1].startswith(f"normlab {argv[0]}: error: "), err[-3000:]
    assert "Traceback" not in err and not [ln for ln in lines[:-1] if "error" in ln.lower()], err[-3000:]
    for part in expected:
        assert part in lines[-1], lines[-1]
    assert snapshot(tmp_path, inputs["bad"], inputs["run"]) == before  # nothing written, nothing changed
    assert not (inputs["bad"] / "MARKER").exists()  # no code from a crafted file ran


def test_a_warm_up_the_run_never_finishes_trains_with_a_warning(inputs, tmp_path, caplog, capsys,
                                                                 lightning_to_capsys):
    """`--optim.warmup_steps` at or above `--trainer.max_steps` (without decay_steps) is trained as given — a quick
    run of the default job does it — with one warning line saying how far the LR gets. The start-up lines held
    until the start's checks passed (the warning, Lightning's seed) are printed once they have."""
    with caplog.at_level("WARNING", logger="training.cli_checks"):
        assert main(["fit", "-c", TINY, "--data.path", str(inputs["data"]), "--runs_dir", str(tmp_path), "--name",
                     "warm", "--trainer.max_steps", "2", "--optim.warmup_steps", "8", "--trainer.logger", "false",
                     "--checkpoint.every_n_steps", "0", "--metrics.every_n_steps", "0"]) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "optim.warmup_steps 8 is not below trainer.max_steps 2: the LR never finishes its warm-up (it ends at 0.25 "
        "of optim.lr); lower --optim.warmup_steps to train at the LR given"]
    err = capsys.readouterr().err
    assert "Seed set to 1234\n" in err and "optim.warmup_steps 8 is not below trainer.max_steps 2" in err, err


def test_every_yaml_read_is_bounded():
    """One YAML reader (training/safe_yaml.py): no other module of normlab parses YAML itself, so none can be fed
    an alias bomb; and a config using anchors, aliases and merge keys as configs do still loads."""
    from training import safe_yaml

    readers = re.compile(r"(?<!\w)yaml\.((safe_|full_|unsafe_)?load(_all)?|compose)\(")
    direct = sorted(str(p.relative_to(REPO)) for root in ("training", "data", "model") for p in (REPO / root).rglob(
        "*.py") if readers.search(p.read_text()))
    assert direct == ["training/safe_yaml.py"]
    text = "base: &b {lr: 0.001, betas: [0.9, 0.95]}\nlow: {<<: *b, lr: 0.0001}\nsame: *b\n"
    assert safe_yaml.load(text, "x") == {"base": {"lr": 0.001, "betas": [0.9, 0.95]},
                                         "low": {"lr": 0.0001, "betas": [0.9, 0.95]},
                                         "same": {"lr": 0.001, "betas": [0.9, 0.95]}}

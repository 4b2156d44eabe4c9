"""`normlab fit --init_from`: from tiny random Hugging Face models (Llama 3 RoPE scaling; Qwen3 with head_dim ≠
dim / n_heads) carrying their own tokenizer, from a normlab checkpoint and from an export; norm surgery; bad
sources. Real processes on CPU, one fit each (`tests/helpers/published.py`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler to stderr at import)
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  a test dependency

from data.datamodule import TokenDataModule  # noqa: E402
from tests.helpers.multiproc import run_here  # noqa: E402
from tests.helpers.published import bpe_tokenizer, fit_args, hf_model_dir, prepared_data, run_config  # noqa: E402
from tests.helpers.runs import (
    read_manifest,
    scalars,  # noqa: E402
)
from tests.test_data_support import prose_documents  # noqa: E402
from training.checkpointing import init_from  # noqa: E402
from training.cli import main  # noqa: E402
from training.run import layout  # noqa: E402

STEP1 = Path("checkpoints") / "step-00000001"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer, data prepared with it, two Hugging Face model directories carrying it, a run config."""
    root = tmp_path_factory.mktemp("published")
    texts = prose_documents(40)
    tok = bpe_tokenizer(root / "bpe", texts)
    return {"root": root, "data": prepared_data(root, tok, texts), "runs": root / "runs",
            "llama3": hf_model_dir(root / "llama3", "llama3", tok), "qwen3": hf_model_dir(root / "qwen3", "qwen3", tok),
            "config": run_config(root / "run.yaml"), "other_tok": bpe_tokenizer(root / "bpe2", texts[::-1], 280)}


def hf_val_loss(hf, data: Path) -> float:
    """transformers' mean cross-entropy over the run's validation batches (the datamodule's own)."""
    dm = TokenDataModule(path=str(data), seq_len=16, batch_size=4, val_batches=2)
    dm.setup("fit")
    losses = []
    with torch.no_grad():
        for batch in dm.val_dataloader():
            logits = hf(batch[:, :-1]).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def from_hf_runs(world) -> dict[str, Path]:
    runs = {}
    for kind in ("llama3", "qwen3"):
        run_here(fit_args(world["config"], world["data"], world["runs"], kind, "--init_from", str(world[kind])))
        runs[kind] = world["runs"] / kind
    return runs


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_from_hugging_face_equals_transformers_and_exports_back(kind, world, from_hf_runs, tmp_path):
    run, source = from_hf_runs[kind], world[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
    # lr 1e-30: the one update leaves every weight as it was, so the validation after it is step 0's
    assert scalars(run, "val/loss")[1] == pytest.approx(hf_val_loss(hf, world["data"]), rel=1e-5, abs=1e-6)
    assert scalars(run, "surgery/kl") == {0: 0.0} and scalars(run, "surgery/max_abs_logit_diff") == {0: 0.0}
    assert scalars(run, "init/hf_max_abs_logit_diff")[0] <= 1e-5
    record = read_manifest(run / STEP1)[init_from.MANIFEST_KEY]
    assert record["kind"] == "huggingface" and record["path"] == str(source.resolve())
    assert record["sha256"] == init_from.resolve(str(source)).sha256
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(run / STEP1), "--output", str(out)]) == 0  # (in this process)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert back.config.head_dim == hf.config.head_dim and back.config.rope_parameters == hf.config.rope_parameters
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() <= 1e-5


def test_from_a_normlab_export_and_checkpoint_unchanged_is_kl_zero(world, from_hf_runs):
    out = world["root"] / "qwen3-export"
    assert main(["export", "--checkpoint", str(from_hf_runs["qwen3"] / STEP1), "--output", str(out), "--format",
                 "safetensors"]) == 0  # (in this process)
    run_here(fit_args(world["config"], world["data"], world["runs"], "from-export", "--init_from", str(out)))
    run = world["runs"] / "from-export"
    assert scalars(run, "surgery/kl") == {0: 0.0}
    assert scalars(run, "val/loss")[1] == pytest.approx(scalars(from_hf_runs["qwen3"], "val/loss")[1], rel=1e-6)
    assert read_manifest(run / STEP1)[init_from.MANIFEST_KEY]["kind"] == "export"
    saved = json.loads((run / STEP1 / layout.MODEL_CONFIG_FILE).read_text())
    assert saved["head_dim"] == 24 and saved["qk_norm"] == "head"  # the source's fields, none given


@pytest.mark.parametrize("source, change, dropped, new", [
    ("qwen3-checkpoint", ["--model.placement", "post"], "attn_res.norm_in.weight", "attn_res.norm_out.weight = 1"),
    ("llama3", ["--model.norm", "dyt", "--model.dyt_alpha", "0.3"], "none", "alpha = model.dyt_alpha (0.3)"),
])
def test_surgery_logs_its_distance_and_trains(source, change, dropped, new, world, from_hf_runs, capsys):
    path = from_hf_runs["qwen3"] / STEP1 if source == "qwen3-checkpoint" else world[source]
    config = run_config(world["root"] / "surgery.yaml", optim={"lr": 3e-3, "min_lr": 3e-3},
                        trainer={"max_steps": 6, "val_check_interval": 6})
    name = f"surgery-{change[1]}"
    capsys.readouterr()
    run_here(fit_args(config, world["data"], world["runs"], name, "--init_from", str(path), *change))
    out = capsys.readouterr()
    run = world["runs"] / name
    assert scalars(run, "surgery/kl")[0] > 1e-4 and scalars(run, "surgery/max_abs_logit_diff")[0] > 1e-3
    summary = next(line for line in (out.out + out.err).splitlines() if "parameters copied" in line)
    assert dropped in summary and new in summary, summary
    losses = scalars(run, "train/loss")
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[6] < losses[1]  # it trains: the recovery curve starts


def _one_line(argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and out == "", err
    return lines[-1]


def test_bad_sources_are_one_line(world, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NORMLAB_DEBUG", raising=False)
    args = fit_args(world["config"], world["data"], tmp_path / "runs", "bad")
    line = _one_line([*args, "--init_from", str(tmp_path / "nowhere")], capsys)
    assert "--init_from" in line and "nowhere: no such directory" in line and "Hugging Face model directory" in line

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in world["qwen3"].iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    line = _one_line([*args, "--init_from", str(broken)], capsys)
    assert f"--init_from {broken}: cannot read it" in line and "file not fully covered" in line

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for file in world["qwen3"].iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    (other / "tokenizer.json").write_bytes(world["other_tok"].read_bytes())
    line = _one_line([*args, "--init_from", str(other)], capsys)
    assert f"{other / 'tokenizer.json'}" in line and str(world["data"] / "tokenizer.json") in line
    assert "normlab prepare --tokenizer" in line
    assert not (tmp_path / "runs").exists()  # nothing written

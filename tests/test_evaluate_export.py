"""`normlab evaluate | export | generate` on checkpoints of real (tiny, single-process) runs.

Exports are loaded back with `transformers` alone (`AutoModelForCausalLM`, `AutoTokenizer`, no network) and
must give our logits and our greedy continuation. DeepSpeed checkpoints are evaluated in
tests/test_training_deepspeed.py, next to the runs that write them.

`generate` (whose exact stdout is checked) runs as its own process; the four fits, `validate`/`test`
(LightningCLI), `evaluate` and `export` run in this one, through the console script's own entry point
(`training.cli.main`: the same parsing, exit status and error line), which saves a process start-up each.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency: if it does not import, these tests fail (they must not skip)

from tests.helpers.data import make_tiny_corpus
from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import scalars, table_value
from training.checkpointing.load import load_checkpoint

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"
STEP = "step-00000004"


def normlab(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """`normlab <args>` in this process: (exit status, what it wrote to stderr)."""
    from training.cli import main

    capsys.readouterr()  # only this command's output
    rc = main(args)
    return rc, capsys.readouterr().err


def ok(args: list[str], capsys: pytest.CaptureFixture) -> None:
    rc, err = normlab(args, capsys)
    assert rc == 0, err[-4000:]


def fit(workdir: Path, preset: str) -> Path:
    from training.cli import main

    assert main(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                 str(workdir / "runs"), "--name", preset, "--model.preset", preset, "--trainer.max_steps", "4",
                 "--model.n_kv_heads", "2"]) == 0
    return workdir / "runs" / preset / "checkpoints" / STEP


@pytest.fixture(scope="module")
def runs(workdir) -> dict[str, Path]:
    return {preset: fit(workdir, preset) for preset in ("llama", "qwen3", "olmo2", "post")}


@pytest.mark.parametrize("preset, model_type", [("llama", "llama"), ("qwen3", "qwen3"), ("olmo2", "olmo2")])
def test_export_loads_in_transformers_with_our_logits_and_tokenizer(preset, model_type, runs, workdir, tmp_path,
                                                                    capsys):
    out = tmp_path / "hf"
    ok(["export", "--checkpoint", str(runs[preset]), "--output", str(out)], capsys)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ours = load_checkpoint(runs[preset]).model
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 16))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5

    import sentencepiece as spm

    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    sp = spm.SentencePieceProcessor(model_file=str(workdir / "tiny" / "tokenizer.model"))
    for text in ("the quick brown fox.", "  two spaces and ünïcode — 🙂\nnew line"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text)
        assert tok.decode(ids) == text
    assert tok.eos_token_id == sp.eos_id()


def test_greedy_generation_equals_transformers(runs, workdir, tmp_path, capsys):
    out = tmp_path / "hf"
    ok(["export", "--checkpoint", str(runs["qwen3"]), "--output", str(out)], capsys)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = "the cat sat on"
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
    from model.generate import generate

    ours = generate(load_checkpoint(runs["qwen3"]).model, ids, 5)  # greedy, KV cache
    assert torch.equal(ours, theirs)
    proc = run_normlab(["generate", "--checkpoint", str(runs["qwen3"]), "--prompt", prompt, "--max_new_tokens", "8",
                        "--temperature", "0"], cwd=workdir)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(workdir / "tiny" / "tokenizer.model"))
    room = 16 - ids.shape[1]  # the CLI stops at the model's max_seq_len (16) and at EOS
    greedy = generate(load_checkpoint(runs["qwen3"]).model, ids, room, eos_id=sp.eos_id())[0, ids.shape[1]:]
    new = [t for t in greedy.tolist() if t != sp.eos_id()]
    expected = prompt + sp.decode(new) + "\n"  # temperature 0: the greedy tokens, decoded
    assert new and proc.stdout == expected.replace("\r\n", "\n").replace("\r", "\n")  # (text mode: universal newlines)


def test_qk_norm_gain_tags_in_tensorboard(runs):
    """The README's QK-norm gain tags: per layer, mean/max/min of the q and k gains, logged at the step-0 audit
    (where the gains are their init, 1) and the last step, in a run with QK-norm (qwen3) — and none without it
    (llama)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def tags(preset: str) -> set[str]:
        acc = EventAccumulator(str(runs[preset].parent.parent))
        acc.Reload()
        return {t for t in acc.Tags()["scalars"] if t.startswith("qk_gain/")}

    expected = {f"qk_gain/{qk}/{stat}/L{l}" for qk in "qk" for stat in ("mean", "max", "min") for l in range(2)}
    assert tags("qwen3") == expected and tags("llama") == set()
    for tag in expected:
        values = scalars(runs["qwen3"].parent.parent, tag)  # the audit, and the last step's probe (step 3)
        assert sorted(values) == [0, 3] and values[0] == 1.0, (tag, values)


def test_evaluate_single_process_checkpoint(runs, workdir, tmp_path, capsys):
    """By default `evaluate` reads the run's own validation windows: its loss is the val/loss the run itself logged at
    that step. Over the whole validation split, bits per byte follow from the loss and meta.json's byte and token
    counts of that split (the windows cover all but its last few tokens)."""
    run = runs["llama"].parent.parent
    out = tmp_path / "eval.json"
    ok(["evaluate", "--checkpoint", str(runs["llama"]), "--output", str(out)], capsys)
    result = json.loads(out.read_text())
    assert result["step"] == 4 and result["tokens"] == 2 * 4 * 16  # val_batches · batch_size · seq_len
    assert result["loss"] == pytest.approx(scalars(run, "val/loss")[4], rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))

    val = json.loads((workdir / "tiny" / "meta.json").read_text())["splits"]["val"]
    windows = (val["tokens"] - 1) // 16
    ok(["evaluate", "--checkpoint", str(runs["llama"]), "--output", str(out), "--max_tokens", str(windows * 16)],
       capsys)
    whole = json.loads(out.read_text())
    assert whole["tokens"] == windows * 16
    expected_bpb = whole["loss"] / math.log(2) * val["tokens"] / val["bytes"]
    assert whole["bits_per_byte"] == pytest.approx(expected_bpb, rel=0.02)


def test_unexportable_config_names_the_field_and_safetensors_still_works(runs, tmp_path, capsys):
    rc, err = normlab(["export", "--checkpoint", str(runs["post"]), "--output", str(tmp_path / "hf")], capsys)
    assert rc == 2
    assert "ModelConfig.norm='layernorm'" in err and "--format safetensors" in err
    assert not (tmp_path / "hf").exists()  # nothing half-written
    out = tmp_path / "own"
    ok(["export", "--checkpoint", str(runs["post"]), "--output", str(out), "--format", "safetensors",
        "--dtype", "bfloat16"], capsys)
    again = load_checkpoint(out)
    original = load_checkpoint(runs["post"]).model
    assert again.model.cfg == original.cfg
    assert all(p.dtype == torch.bfloat16 for p in load_safetensors(out))  # what was written is bf16
    with torch.no_grad():  # the same model with its weights rounded to bf16, evaluated in fp32
        for p in original.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tokens = torch.randint(0, again.model.cfg.vocab_size, (1, 8))
    with torch.no_grad():
        assert (again.model(tokens).float() - original(tokens)).abs().max().item() <= 1e-5


def load_safetensors(out: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in sorted(out.glob("*.safetensors")) for t in load_file(f).values()]


def test_bad_inputs_give_clear_errors(runs, tmp_path, capsys):
    def fails(*args: str) -> str:
        rc, err = normlab(list(args), capsys)
        assert rc == 2, err
        return err

    assert "does not exist" in fails("evaluate", "--checkpoint", str(tmp_path / "nope"))

    broken = tmp_path / "broken"
    shutil.copytree(runs["llama"], broken / "checkpoints" / STEP)
    ckpt_file = broken / "checkpoints" / STEP / "model.ckpt"
    ckpt_file.write_bytes(ckpt_file.read_bytes()[: ckpt_file.stat().st_size // 2])
    assert "truncated" in fails("evaluate", "--checkpoint", str(broken / "checkpoints" / STEP))

    incomplete = tmp_path / "incomplete"
    shutil.copytree(runs["llama"], incomplete)
    (incomplete / "manifest.json").unlink()
    assert "not a complete checkpoint" in fails("export", "--checkpoint", str(incomplete), "--output",
                                                str(tmp_path / "x"))

    other = tmp_path / "other"
    other.mkdir()
    make_tiny_corpus(other, vocab_size=300)  # same text, another tokenizer
    assert "different tokenizer" in fails("evaluate", "--checkpoint", str(runs["llama"]), "--data",
                                          str(other / "tiny"))


def test_normlab_test_and_validate_on_a_checkpoint(runs, workdir, capsys):
    """`normlab test` / `validate` (LightningCLI) on a saved checkpoint: the held-out split is the run's validation
    windows, so each prints the val/loss the run logged at step 4 (the checkpoint's weights)."""
    from training.cli import main

    logged = scalars(runs["llama"].parent.parent, "val/loss")[4]
    for command, tag in (("validate", "val/loss"), ("test", "test/loss")):
        capsys.readouterr()
        assert main([command, "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                     str(workdir / "runs"), "--name", "llama", "--model.n_kv_heads", "2",
                     "--ckpt_path", str(runs["llama"])]) == 0
        out = capsys.readouterr()
        assert table_value(out.out + out.err, tag) == pytest.approx(logged, rel=1e-6), command


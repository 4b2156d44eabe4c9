"""Bring your own tokenizer: a Hugging Face `tokenizer.json` (a `tokenizers` BPE trained here on the test corpus)
through prepare, training, evaluate, export and generate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data import layout
from data.errors import DataError
from data.prepare import prepare
from data.tokenizer import open_tokenizer, sha256_file
from tests.test_data_support import TRICKY, prose_documents

EOT = "<|endoftext|>"


def train_bpe(texts: list[str], out: Path, specials: tuple[str, ...] = (EOT,), vocab_size: int = 600) -> Path:
    """A GPT-2-style byte-level BPE, saved as ``out/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return prose_documents(30) + TRICKY


@pytest.fixture(scope="module")
def hf_dir(docs: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(docs, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def hf_prepared(docs: list[str], hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hfprep")
    (root / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return prepare([root / "d.jsonl"], output=root / "out", tokenizer=hf_dir, val_fraction=0.2)


def test_ids_equal_the_librarys_own_encode(docs: list[str], hf_dir: Path, hf_prepared: Path) -> None:
    from tokenizers import Tokenizer

    lib = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    meta = layout.read_meta(hf_prepared)
    eos = lib.token_to_id(EOT)
    assert (meta["tokenizer_kind"], meta["tokenizer_path"], meta["eos_id"]) == ("tokenizers", "tokenizer.json", eos)
    assert meta["vocab_size"] == lib.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["tokenizer_sha256"] == sha256_file(hf_dir / "tokenizer.json")
    found = []
    for split in ("train", "val"):
        tokens = layout.open_tokens(hf_prepared, meta, split)
        starts = layout.document_starts(hf_prepared, split)
        ends = np.append(starts[1:], len(tokens))
        found += [tokens[s:e].tolist() for s, e in zip(starts, ends, strict=True)]
    expected = [lib.encode(d, add_special_tokens=False).ids + [eos] for d in docs]
    assert sorted(found) == sorted(expected) and meta["splits"]["val"]["documents"] > 0


def test_piece_bytes_count_every_byte(docs: list[str], hf_prepared: Path) -> None:
    tok = layout.load_tokenizer(hf_prepared / "tokenizer.json")
    per_id = tok.piece_bytes()
    assert per_id[tok.eos_id] == 0
    for doc in docs:
        assert int(per_id[tok.encode_batch([doc])[0]].sum()) == len(doc.encode("utf-8"))
        assert tok.decode(tok.encode_batch([doc])[0]) == doc


def test_eos_comes_from_the_config_or_a_flag(docs: list[str], tmp_path: Path) -> None:
    plain = train_bpe(docs, tmp_path / "plain", specials=("[END]",))
    with pytest.raises(DataError, match=r"no recognizable end-of-document token .*pass its id with --eos_id"):
        open_tokenizer(plain)
    end = open_tokenizer(plain, eos_id=0).eos_id
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[END]"}))
    assert open_tokenizer(plain).eos_id == end == 0
    with pytest.raises(DataError, match=r"EOS id 5000 is outside the vocabulary"):
        open_tokenizer(plain, eos_id=5000)
    (plain / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"is not a Hugging Face tokenizer.json"):
        open_tokenizer(plain / "tokenizer.json")


def test_a_flag_given_eos_survives_the_copy(docs: list[str], tmp_path: Path) -> None:
    """The prepared directory holds a bare tokenizer.json: its EOS comes back from meta.json."""
    plain = train_bpe(docs, tmp_path / "plain", specials=("[END]", "[X]"))
    (tmp_path / "a.txt").write_text(docs[0])
    out = prepare([tmp_path / "a.txt"], output=tmp_path / "out", tokenizer=plain / "tokenizer.json", eos_id=1,
                  val_fraction=0.0)
    assert layout.read_meta(out)["eos_id"] == 1 == layout.load_tokenizer(out / "tokenizer.json").eos_id
    assert np.fromfile(out / "train.bin", dtype=np.uint16)[-1] == 1


@pytest.mark.slow
def test_fit_evaluate_export_generate_with_a_hf_tokenizer(hf_prepared: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """`fit` as its own process; `export` and `generate` in this one (the console script's entry point)."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.multiproc import REPO, run_here
    from training.cli import main
    from training.eval.heldout import evaluate

    run_here(["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--data.path", str(hf_prepared),
              "--runs_dir", str(tmp_path / "runs"), "--name", "bpe", "--trainer.max_steps", "4"])
    ckpt = tmp_path / "runs" / "bpe" / "checkpoints" / "step-00000004"
    result = evaluate(ckpt, log_to_run=False)
    meta = layout.read_meta(hf_prepared)
    # bits per byte through the tokenizer interface: the split's byte count per token (meta.json, counted from
    # the text) is what the evaluated windows average to, within the spread of a few windows
    assert result["bytes"] / result["tokens"] == pytest.approx(
        meta["splits"]["val"]["bytes"] / meta["splits"]["val"]["tokens"], rel=0.25)
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(ckpt), "--output", str(out)]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    lib = layout.load_tokenizer(hf_prepared / "tokenizer.json")
    for text in ("the quick brown fox.", TRICKY[1]):
        assert auto.encode(text, add_special_tokens=False) == lib.encode_batch([text])[0]
    assert auto.eos_token_id == meta["eos_id"]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "The", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The")

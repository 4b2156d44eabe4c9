"""normlab prepare: round trips, meta.json, fingerprints, atomic output and every bad input of issue 3."""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import numpy as np
import pytest

from data import corpus, layout, packing
from data import prepare as prep
from data.default_corpus import gather_default_corpus
from data.errors import DataError
from data.prepare import ensure_default_corpus, main, prepare
from data.tokenizer import NORMALIZATION_NOTE, load_processor, sha256_file
from tests.test_data_support import TRICKY, VOCAB, decode_documents, prose_documents, write_corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def prepared(corpus_dir: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All formats, no validation split, a trained tokenizer."""
    out = tmp_path_factory.mktemp("prepared") / "all"
    prepare([corpus_dir[0]], output=out, text_field="body", vocab_size=VOCAB, val_fraction=0.0)
    return out


def test_round_trip_all_formats(prepared: Path, corpus_dir: tuple[Path, list[str]]) -> None:
    assert decode_documents(prepared, "train") == corpus_dir[1]
    assert layout.read_meta(prepared)["splits"]["val"]["tokens"] == 0


def test_round_trip_normalization_is_only_the_meta_symbol(prepared: Path) -> None:
    sp = load_processor(prepared / layout.TOKENIZER_FILE)
    for text in TRICKY + ["\x00 control \x1b bytes", "▁meta▁symbol"]:
        assert sp.decode(sp.encode(text)) == text.replace("▁", " ")
    assert "U+2581" in NORMALIZATION_NOTE


def test_meta_matches_arrays(prepared: Path, corpus_dir: tuple[Path, list[str]]) -> None:
    meta = layout.read_meta(prepared)
    docs = corpus_dir[1]
    sp = load_processor(prepared / meta["tokenizer_path"])
    tokens = np.fromfile(prepared / "train.bin", dtype=meta["dtype"])
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB == sp.get_piece_size()
    assert meta["tokenizer_sha256"] == sha256_file(prepared / "tokenizer.model")
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (sp.bos_id(), sp.eos_id(), sp.pad_id())
    assert meta["pad_id"] >= 0
    train = meta["splits"]["train"]
    assert train["tokens"] == len(tokens) == sum(len(sp.encode(d)) + 1 for d in docs)
    assert train["documents"] == len(docs) == int((tokens == meta["eos_id"]).sum())
    assert train["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    assert tokens.max() < meta["vocab_size"]
    files = meta["sources"]["files"]
    assert len(files) == 8 + len(TRICKY) + 2  # txt files + jsonl + parquet, not the .csv
    assert all(f["sha256"] == sha256_file(f["path"]) for f in files)
    assert set(meta) >= {"version", "tokenizer_path", "vocab_size", "fingerprint", "splits", "unk_id"}


def test_dtype_switch_at_65535() -> None:
    assert layout.token_dtype(65_535) == np.uint16
    assert layout.token_dtype(65_536) == np.uint32


def test_uint32_tokens_survive_packing(tmp_path: Path) -> None:
    writer = packing.SplitWriter(tmp_path, np.dtype("uint32"), 2, 0.0, packing.PackState())
    writer.write([(0, "abcde"), (1, "fghij")], [[70_000, 65_535], [131_071]])
    writer.close()
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint32).tolist() == [70_000, 65_535, 2, 131_071, 2]
    assert np.fromfile(tmp_path / "train.idx", dtype=np.int64).tolist() == [0, 3]
    assert writer.state.counts["train"].tokens == 5 and writer.state.counts["val"].documents == 0


def test_document_starts_match_each_documents_own_tokens(tmp_path: Path, prepared: Path) -> None:
    """train.idx/val.idx against the documents' own token counts (tokenizer.encode + EOS), both splits."""
    docs = prose_documents(30)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare([tmp_path / "d.jsonl"], output=tmp_path / "out", tokenizer=prepared / "tokenizer.model",
                  val_fraction=0.3)
    sp = load_processor(out / "tokenizer.model")
    val = set(decode_documents(out, "val"))
    meta = layout.read_meta(out)
    for split, chosen in (("train", [d for d in docs if d not in val]), ("val", [d for d in docs if d in val])):
        expected = [len(sp.encode(d)) + 1 for d in chosen]
        assert layout.document_lengths(out, split).tolist() == expected and expected
        starts = layout.document_starts(out, split)
        assert starts.tolist() == np.concatenate([[0], np.cumsum(expected)[:-1]]).tolist()
        assert meta["splits"][split]["index"] == f"{split}.idx"
    # A directory prepared before the index existed: recovered from the EOS positions, the same.
    del meta["splits"]["train"]["index"]
    assert layout.document_starts(out, "train", meta).tolist() == layout.document_starts(out, "train").tolist()


def test_val_split_by_documents_is_deterministic(corpus_dir: tuple[Path, list[str]], tmp_path: Path) -> None:
    out = prepare([corpus_dir[0]], output=tmp_path / "v", text_field="body", vocab_size=VOCAB, val_fraction=0.2)
    meta = layout.read_meta(out)
    train, val = decode_documents(out, "train"), decode_documents(out, "val")
    assert meta["settings"]["val_split"] == "documents"
    assert sorted(train + val) == sorted(corpus_dir[1]) and val and train
    assert meta["splits"]["val"]["bytes"] == sum(len(d.encode()) for d in val)
    scores = packing.val_scores(np.arange(1000))
    assert 150 < (scores < 0.2).sum() < 250 and np.array_equal(scores, packing.val_scores(np.arange(1000)))


def test_single_document_splits_at_the_tail(tmp_path: Path) -> None:
    text = "\n\n".join(prose_documents(30))
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    out = prepare([tmp_path / "book.txt"], output=tmp_path / "out", vocab_size=VOCAB, val_fraction=0.1)
    meta = layout.read_meta(out)
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    sp = load_processor(out / layout.TOKENIZER_FILE)
    assert meta["settings"]["val_split"] == "tail"
    assert len(val) == meta["splits"]["val"]["tokens"] == pytest.approx(0.1 * (len(train) + len(val)), abs=1)
    assert sp.decode(train.tolist() + val.tolist()) == text
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == pytest.approx(len(text.encode()), abs=3)


def test_num_proc_2_gives_identical_output(corpus_dir: tuple[Path, list[str]], prepared: Path, tmp_path: Path) -> None:
    out = prepare([corpus_dir[0]], output=tmp_path / "p2", text_field="body", tokenizer=prepared / "tokenizer.model",
                  val_fraction=0.0, num_proc=2)
    assert (out / "train.bin").read_bytes() == (prepared / "train.bin").read_bytes()


def test_training_and_tokenizing_are_reproducible(
    corpus_dir: tuple[Path, list[str]], prepared: Path, tmp_path: Path
) -> None:
    again = prepare([corpus_dir[0]], output=tmp_path / "again", text_field="body", vocab_size=VOCAB, val_fraction=0.0)
    for name in ("tokenizer.model", "train.bin"):
        assert (again / name).read_bytes() == (prepared / name).read_bytes()


def test_repeat_is_a_no_op(prepared: Path, corpus_dir: tuple[Path, list[str]]) -> None:
    before = (prepared / layout.META_FILE).stat().st_mtime_ns
    prepare([corpus_dir[0]], output=prepared, text_field="body", vocab_size=VOCAB, val_fraction=0.0)
    assert (prepared / layout.META_FILE).stat().st_mtime_ns == before


def test_refuses_a_different_fingerprint_unless_overwrite(prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / "a.txt").write_text(" ".join(prose_documents(3)))
    prepare([tmp_path / "a.txt"], output=out, tokenizer=prepared / "tokenizer.model", val_fraction=0.0)
    (tmp_path / "a.txt").write_text(" ".join(prose_documents(4)))
    with pytest.raises(DataError, match=r"holds data prepared from different sources or settings.*--overwrite"):
        prepare([tmp_path / "a.txt"], output=out, tokenizer=prepared / "tokenizer.model", val_fraction=0.0)
    prepare([tmp_path / "a.txt"], output=out, tokenizer=prepared / "tokenizer.model", val_fraction=0.0, overwrite=True)
    assert decode_documents(out, "train") == [" ".join(prose_documents(4))]


def test_refuses_shards_made_with_another_tokenizer(prepared: Path, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(" ".join(prose_documents(12)))
    out = prepare([tmp_path / "a.txt"], output=tmp_path / "out", vocab_size=400, val_fraction=0.0)
    with pytest.raises(DataError, match=r"prepared with a different tokenizer \(sha256 \w+….*--overwrite"):
        prepare([tmp_path / "a.txt"], output=out, tokenizer=prepared / "tokenizer.model", val_fraction=0.0)


def test_never_deletes_a_foreign_directory(tmp_path: Path, prepared: Path) -> None:
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("years of work")
    (tmp_path / "a.txt").write_text("some text " * 50)
    with pytest.raises(DataError, match=r"'.*precious' exists and is not a prepared directory"):
        prepare([tmp_path / "a.txt"], output=tmp_path / "precious", tokenizer=prepared / "tokenizer.model",
                overwrite=True)
    assert (tmp_path / "precious" / "thesis.tex").exists()


def test_interrupted_prepare_leaves_nothing_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "out"

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C while the tokenizer was being trained

    monkeypatch.setattr(prep, "train_tokenizer", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "a.txt"], output=out, vocab_size=VOCAB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no output, no temporary directory


def test_resume_continues_an_interrupted_prepare_exactly(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after 3 batches, resumed: the same bytes as a straight run, and the first batches not re-encoded."""
    docs = prose_documents(40)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    kwargs = {"tokenizer": prepared / "tokenizer.model", "val_fraction": 0.2}
    monkeypatch.setattr(packing, "BATCH_DOCUMENTS", 4)
    monkeypatch.setattr(prep, "PROGRESS_SECONDS", 0.0)  # save progress after every batch
    straight = prepare([tmp_path / "d.jsonl"], output=tmp_path / "straight", **kwargs)

    written: list[int] = []
    real_write = packing.SplitWriter.write

    def write(self, batch, ids, max_tokens=None):
        if len(written) == 3 and not resumed:
            raise KeyboardInterrupt  # killed while the 4th batch was being written
        written.append(batch[0][0])
        return real_write(self, batch, ids, max_tokens)

    monkeypatch.setattr(packing.SplitWriter, "write", write)
    resumed = False
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "d.jsonl"], output=out, **kwargs)
    partial = tmp_path / ".out.partial"
    assert not out.exists() and (partial / "progress.json").is_file() and not (partial / "meta.json").exists()
    (partial / "train.bin").open("ab").write(b"\x01\x02")  # bytes written after the last saved progress
    resumed, written = True, []
    prepare([tmp_path / "d.jsonl"], output=out, resume=True, **kwargs)
    assert written[0] == 12  # the first 3 batches of 4 documents were not encoded again
    for name in ("train.bin", "val.bin", "train.idx", "val.idx"):
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name
    assert layout.read_meta(out)["splits"] == layout.read_meta(straight)["splits"]
    assert not partial.exists() and not (out / "progress.json").exists()


def test_without_resume_a_leftover_partial_is_discarded(tmp_path: Path, prepared: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 50)
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    (partial / "progress.json").write_text('{"fingerprint": "other"}')
    with pytest.raises(DataError, match=r"--resume: the interrupted prepare in '.*\.out\.partial' was for other"):
        prepare([tmp_path / "a.txt"], output=tmp_path / "out", tokenizer=prepared / "tokenizer.model", resume=True)
    out = prepare([tmp_path / "a.txt"], output=tmp_path / "out", tokenizer=prepared / "tokenizer.model")
    assert layout.read_meta(out) is not None and not partial.exists()


def test_encoding_errors(tmp_path: Path, prepared: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes("ok é ".encode() + b"\xff\xfe tail")
    message = r"'.*bad\.txt' is not valid UTF-8: invalid byte at offset 6.*--encoding_errors replace"
    with pytest.raises(DataError, match=message):
        prepare([bad], output=tmp_path / "out", tokenizer=prepared / "tokenizer.model")
    out = prepare([bad], output=tmp_path / "out", tokenizer=prepared / "tokenizer.model", val_fraction=0.0,
                  encoding_errors="replace")
    assert decode_documents(out, "train") == ["ok é \ufffd\ufffd tail"]


def test_bad_utf8_offset_across_chunk_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "_CHUNK", 4)
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"t": "\xc3\xa9\xe2\x82"}')  # é, then a truncated 3-byte sequence closed by a quote
    assert corpus.inspect_files([path], "replace")[0].bad_utf8_offset == 9
    path.write_bytes(b"abc\xe2\x82")  # truncated at end of file
    assert corpus.inspect_files([path], "replace")[0].bad_utf8_offset == 3


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _missing(d: Path) -> Path:
    return d / "missing.txt"


def _empty_file(d: Path) -> Path:
    return _write(d / "empty.txt", "")


def _directory_without_inputs(d: Path) -> Path:
    return _write(d / "dir" / "notes.csv", "a,b").parent


def _directory_of_empty_files(d: Path) -> Path:
    return _write(d / "dir" / "empty.jsonl", "").parent


def _unsupported_file(d: Path) -> Path:
    return _write(d / "data.csv", "a,b")


def _glob_without_matches(d: Path) -> Path:
    return d / "nothing" / "*.txt"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_missing, r"input path '.*missing\.txt' does not exist"),
        (_empty_file, r"input file '.*empty\.txt' is empty"),
        (_directory_without_inputs, r"input directory '.*dir' contains no usable files"),
        (_directory_of_empty_files, r"input directory '.*dir' contains no usable files"),
        (_unsupported_file, r"'.*data\.csv' has an unsupported extension"),
        (_glob_without_matches, r"input glob '.*\*\.txt' matched no non-empty"),
    ],
)
def test_bad_inputs_name_the_path(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(DataError, match=message):
        prepare([make(tmp_path)], output=tmp_path / "out", vocab_size=VOCAB)


def test_json_without_the_text_field(tmp_path: Path) -> None:
    (tmp_path / "r.jsonl").write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(DataError, match=r"have no field 'text' \(fields: content\); pass --text_field"):
        prepare([tmp_path / "r.jsonl"], output=tmp_path / "out", vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, r"--vocab_size 100 is too small.*at least 261"),
        ({"vocab_size": 5000}, r"cannot train a tokenizer with --vocab_size 5000.*<= \d+"),
        ({"val_fraction": 0.9}, r"--val_fraction 0.9 must be between 0 and 0.5"),
        ({"num_proc": 0}, r"--num_proc 0 must be at least 1"),
        ({"hf_dataset": "x/y"}, r"either --input or --hf_dataset"),
        ({"tokenizer": "nope.model"}, r"tokenizer file 'nope.model' does not exist"),
    ],
)
def test_bad_settings(tmp_path: Path, kwargs: dict, message: str) -> None:
    (tmp_path / "a.txt").write_text("a small corpus of a few words " * 20)
    with pytest.raises(DataError, match=message):
        prepare([tmp_path / "a.txt"], output=tmp_path / "out", **kwargs)


def test_hub_dataset_without_network_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(corpus, "HUB_PROBE_TIMEOUT", 0.5)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # never resolves
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"cannot reach https://hub.invalid to download --hf_dataset 'a/b'.*--input"):
        prepare(hf_dataset="a/b", output=tmp_path / "out")
    assert time.perf_counter() - start < 5


def test_hub_dataset_offline_mode_names_the_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"could not load --hf_dataset 'normlab/absent'.*local cache \(offline mode\)"):
        prepare(hf_dataset="normlab/absent", output=tmp_path / "out")


def test_hub_dataset_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prepared: Path) -> None:
    """The --hf_dataset path end to end, offline: `datasets` resolves a local directory like a Hub repository."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text("".join(json.dumps({"story": d}) + "\n" for d in prose_documents(5)))
    with pytest.raises(DataError, match=r"records of '.*repo' have no field 'text' \(fields: story\)"):
        prepare(hf_dataset=str(repo), output=tmp_path / "out", tokenizer=prepared / "tokenizer.model")
    out = prepare(hf_dataset=str(repo), text_field="story", output=tmp_path / "out",
                  tokenizer=prepared / "tokenizer.model", val_fraction=0.0)
    assert decode_documents(out, "train") == prose_documents(5)
    assert layout.read_meta(out)["sources"]["kind"] == "hf"


def test_cli_reports_errors_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--input", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]) == 2
    assert "normlab prepare: error: input path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path)])  # --output is required with inputs
    assert "--output is required" in capsys.readouterr().err
    assert prep.build_parser().prog == "normlab prepare"


def test_cli_prepares_with_a_given_tokenizer(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.txt").write_text("plenty of words here " * 40)
    argv = ["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
            "--tokenizer", str(prepared / "tokenizer.model"), "--val_fraction", "0"]
    assert main(argv) == 0
    assert "train: " in capsys.readouterr().out
    assert decode_documents(tmp_path / "out", "train") == ["plenty of words here " * 40]


# --- the default corpus: built once, with a small vocabulary -------------------------------------------------
@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default") / "corpus"
    assert main(["--output", str(out), "--vocab_size", str(VOCAB)]) == 0
    return out


def test_no_input_builds_the_default_corpus_offline(default_dir: Path) -> None:
    meta = layout.read_meta(default_dir)
    assert meta["sources"]["kind"] == "default"
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] >= 5_000_000
    assert meta["splits"]["val"]["documents"] > 10
    assert not layout.problems(default_dir, meta)


def test_ensure_default_corpus_is_idempotent_and_fast(default_dir: Path) -> None:
    before = (default_dir / layout.META_FILE).stat().st_mtime_ns
    start = time.perf_counter()
    assert ensure_default_corpus(default_dir, vocab_size=VOCAB) == default_dir
    assert time.perf_counter() - start < 1.0
    assert (default_dir / layout.META_FILE).stat().st_mtime_ns == before


def test_ensure_default_corpus_keeps_a_user_corpus(prepared: Path) -> None:
    with pytest.raises(DataError, match=r"holds a corpus prepared from other sources, not the default corpus"):
        ensure_default_corpus(prepared)


def test_gathering_is_deterministic_and_deduplicated() -> None:
    first, second = gather_default_corpus(200_000), gather_default_corpus(200_000)
    assert first == second and sum(len(d.encode()) for d in first) >= 200_000
    paragraphs = [" ".join(p.lower().split()) for doc in first for p in doc.split("\n\n")]
    assert len(paragraphs) == len(set(paragraphs)) > 100


# --- streamed Hub datasets and --max_tokens ------------------------------------------------------------------
def _local_hub_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs: list[str]) -> Path:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return repo


def test_streamed_hub_dataset_equals_the_downloaded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prepared: Path
) -> None:
    repo = _local_hub_repo(tmp_path, monkeypatch, prose_documents(30))
    kwargs = {"hf_dataset": str(repo), "tokenizer": prepared / "tokenizer.model", "val_fraction": 0.2}
    whole = prepare(output=tmp_path / "whole", **kwargs)
    streamed = prepare(output=tmp_path / "streamed", streaming=True, **kwargs)
    for name in ("train.bin", "val.bin", "train.idx"):
        assert (streamed / name).read_bytes() == (whole / name).read_bytes()
    assert layout.read_meta(streamed)["sources"]["streaming"] is True
    with pytest.raises(DataError, match=r"--streaming applies to --hf_dataset"):
        prepare([repo / "train.jsonl"], output=tmp_path / "x", streaming=True)


def test_max_tokens_stops_at_the_first_document_boundary_after_n(tmp_path: Path, prepared: Path) -> None:
    docs = prose_documents(30)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    sp = load_processor(prepared / "tokenizer.model")
    lengths = np.array([len(sp.encode(d)) + 1 for d in docs])
    limit = int(lengths[:7].sum()) - 5  # inside the 7th document
    out = prepare([tmp_path / "d.jsonl"], output=tmp_path / "out", tokenizer=prepared / "tokenizer.model",
                  val_fraction=0.0, max_tokens=limit)
    assert decode_documents(out, "train") == docs[:7]
    with pytest.raises(DataError, match=r"--max_tokens 0 must be at least 1"):
        prepare([tmp_path / "d.jsonl"], output=tmp_path / "o2", max_tokens=0)


def test_a_concurrent_prepare_builds_privately(tmp_path: Path, prepared: Path) -> None:
    """While another process holds the output's partial directory (as another node's prepare_data would), a
    prepare of the same output builds in a private directory and publishes; the holder's directory is untouched."""
    from data import output_dir

    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "out"
    with output_dir.staging(out) as held:
        (held / "marker").write_text("mine")
        prepare([tmp_path / "a.txt"], output=out, tokenizer=prepared / "tokenizer.model", val_fraction=0.0)
        assert layout.read_meta(out) is not None and (held / "marker").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]


def test_resume_of_a_streamed_hub_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prepared: Path) -> None:
    repo = _local_hub_repo(tmp_path, monkeypatch, prose_documents(30))
    kwargs = {"hf_dataset": str(repo), "tokenizer": prepared / "tokenizer.model", "val_fraction": 0.2,
              "streaming": True}
    monkeypatch.setattr(packing, "BATCH_DOCUMENTS", 4)
    monkeypatch.setattr(prep, "PROGRESS_SECONDS", 0.0)
    straight = prepare(output=tmp_path / "straight", **kwargs)
    calls: list[int] = []
    crash = [True]
    real_write = packing.SplitWriter.write

    def write(self, batch, ids, max_tokens=None):
        calls.append(batch[0][0])
        if len(calls) == 3 and crash[0]:
            raise KeyboardInterrupt
        return real_write(self, batch, ids, max_tokens)

    monkeypatch.setattr(packing.SplitWriter, "write", write)
    with pytest.raises(KeyboardInterrupt):
        prepare(output=tmp_path / "out", **kwargs)
    calls.clear()
    crash[0] = False
    out = prepare(output=tmp_path / "out", resume=True, **kwargs)
    assert calls[0] == 8  # streamed records before the saved progress were skipped, not re-encoded
    for name in ("train.bin", "val.bin", "train.idx", "val.idx"):
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name


def test_an_oversized_document_is_refused_in_one_line_leaving_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A document over the bound (a 1 GB single line aborted sentencepiece with std::bad_alloc) is refused naming
    the file, before a .txt file is read, and mid-stream for a JSON-lines record; no `.partial` is left behind."""
    monkeypatch.setattr(corpus, "MAX_DOCUMENT_BYTES", 4096)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.txt").write_text("abcdefgh " * 500)
    assert main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--vocab_size", "300"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "big.txt' (one .txt file is one document) holds 4,500 bytes, more than the 4,096" in err
    (tmp_path / "in" / "big.txt").unlink()
    rows = [{"text": "short words here " * 10}] * 3 + [{"text": "é" * 4000}]  # 4,000 characters, 8,000 bytes
    (tmp_path / "in" / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"record 4 of json input '.*r\.jsonl' holds 8,000 bytes"):
        prepare([tmp_path / "in"], output=tmp_path / "out", vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_lines_sentencepiece_cannot_train_on_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """sentencepiece drops training lines over its bound without a word: a corpus of only such lines failed with
    an empty reason, and a mixed one trained on part of its text silently. Both now say how many were left out."""
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "a.txt").write_text("abcdefgh " * 8000)  # one 72,000-byte line
    with pytest.raises(DataError, match=r"1 line\(s\) longer than sentencepiece's 65,536-byte bound on a training "
                                        r"line, the longest 72,000 bytes, were left out"):
        prepare([tmp_path / "long"], output=tmp_path / "out", vocab_size=VOCAB)
    (tmp_path / "long" / "b.txt").write_text("\n".join(prose_documents(40)))
    with caplog.at_level("WARNING"):
        prepare([tmp_path / "long"], output=tmp_path / "out", vocab_size=VOCAB, val_fraction=0.0)
    assert "the tokenizer was trained without 1 line(s) longer than sentencepiece's" in caplog.text

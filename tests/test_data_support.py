"""Shared helpers for the data tests (no tests here): small corpora and decoding of prepared splits.

Kept in a ``test_data_*`` module because the data tests own only those files; pytest collects nothing here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Belt and braces for a run where this module is imported before `datasets`: tests never need the Hub (local
# loads already skip `datasets`' download counter, see data.corpus).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from data.layout import open_tokens, read_meta  # noqa: E402
from data.tokenizer import load_processor  # noqa: E402

VOCAB = 384  # small: byte fallback (256) + specials (4) + characters + a few merges
# Text that a careless pipeline would mangle: runs of spaces, tabs, CRLF, blank lines, non-ASCII, emoji, a
# leading space, trailing whitespace.
TRICKY = [
    "  leading spaces\tand\ttabs\r\nwindows line end\n\n\nthree newlines  ",
    "Ünïcödé façade — naïve café; 中文字符; emoji 😀👍; math ∑ ∞ ≠",
    "digits 1234567890 and 3.14159, code: def f(x): return x ** 2",
]


def prose_documents(n: int = 40) -> list[str]:
    """Real English from the Python language reference, as in the default corpus."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)[:n]]


def write_corpus(root: Path) -> list[str]:
    """A directory with .txt, .jsonl (field "body") and .parquet inputs; returns the documents in load order
    (text files, then json records, then parquet records). ``datasets`` reads .txt files with universal
    newlines, so their CR LF and lone CR come back as LF."""
    docs = prose_documents(24)
    txt_docs, json_docs, parquet_docs = docs[:8] + TRICKY, docs[8:16], docs[16:]
    (root / "nested").mkdir(parents=True)
    for i, doc in enumerate(txt_docs):
        folder = root / "nested" if i % 2 else root
        (folder / f"doc{i:02d}.txt").write_bytes(doc.encode("utf-8"))
    with open(root / "records.jsonl", "w", encoding="utf-8") as f:
        for doc in json_docs:
            f.write(json.dumps({"body": doc, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": parquet_docs}), root / "records.parquet")
    (root / "ignored.csv").write_text("not an input format")
    # The text loader takes files in sorted path order; the test compares against that order.
    txt_order = sorted(
        ((root / "nested" if i % 2 else root) / f"doc{i:02d}.txt", doc) for i, doc in enumerate(txt_docs)
    )
    return [_lf(doc) for _, doc in txt_order] + json_docs + parquet_docs


def _lf(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def decode_documents(directory: Path, split: str) -> list[str]:
    """Decode a prepared split back into documents (split at EOS)."""
    meta = read_meta(directory)
    tokens = np.asarray(open_tokens(directory, meta, split))
    sp = load_processor(directory / meta["tokenizer_path"])
    ends = np.flatnonzero(tokens == meta["eos_id"])
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [sp.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]

"""The sentencepiece tokenizer: train one, or check and describe an existing ``.model`` file.

Training settings follow Llama's tokenizer where it matters for round trips: BPE with byte fallback (any UTF-8
text encodes, nothing maps to <unk>), identity normalization and no whitespace collapsing, so
``decode(encode(text)) == text`` except that the meta symbol U+2581 (``▁``) decodes as a space. We also drop the
dummy prefix space, which Llama adds, so a document's first word needs no special case in that round trip.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from data.errors import DataError

logger = logging.getLogger(__name__)

# Special ids as in Llama's tokenizer (unk 0, bos 1, eos 2) plus a real pad id, never -1.
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
# Bump when TRAINER_OPTIONS change: a prepared directory's fingerprint includes it.
TRAINER_VERSION = 1
TRAINER_OPTIONS = {
    "model_type": "bpe",
    "byte_fallback": True,
    "character_coverage": 0.9995,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "split_digits": True,
    "allow_whitespace_only_pieces": True,
    # Docstring and prose lines are short, but one long line should not be dropped silently.
    "max_sentence_length": 1 << 16,
    "minloglevel": 2,
    **SPECIAL_IDS,
}
NORMALIZATION_NOTE = "exact round trip, except U+2581 ('▁') decodes as a space"


@dataclass(frozen=True)
class TokenizerInfo:
    """What a prepared directory records about its tokenizer."""

    sha256: str
    vocab_size: int
    unk_id: int
    bos_id: int
    eos_id: int
    pad_id: int


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def train_tokenizer(lines: Iterable[str], vocab_size: int, output: Path, num_threads: int = 1) -> TokenizerInfo:
    """Train a BPE model on ``lines`` (one sentence each) and write it to ``output``."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, num_threads=num_threads,
            **TRAINER_OPTIONS,
        )
    except RuntimeError as e:
        # sentencepiece reports "INTERNAL: src/file.cc(638) [check] message"; keep the message, which gives
        # the bound ("Please set it to a value <= 307", "270 vs 344").
        reason = re.sub(r"^.*?\] ", "", str(e))
        raise DataError(
            f"cannot train a tokenizer with --vocab-size {vocab_size} on this corpus: {reason} "
            "Choose a --vocab-size in the range sentencepiece gives, or supply more text."
        ) from e
    output.write_bytes(model.getvalue())
    info = describe_tokenizer(output)
    logger.info("trained a %d-piece BPE tokenizer", info.vocab_size)
    return info


def load_processor(path: str | Path) -> spm.SentencePieceProcessor:
    """Load a ``.model`` file, with an error that names the file when it is missing or not a model."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file '{path}' does not exist; pass a sentencepiece .model file")
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise DataError(f"tokenizer file '{path}' is not a sentencepiece model: {e}") from e


def describe_tokenizer(path: str | Path) -> TokenizerInfo:
    """Read the ids and size of a tokenizer; EOS is required because it separates documents."""
    sp = load_processor(path)
    if sp.eos_id() < 0:
        raise DataError(f"tokenizer '{path}' has no EOS piece; normlab separates documents with EOS")
    # A model without a pad piece pads with EOS: padded positions are masked anyway, and -1 is no id.
    pad_id = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    return TokenizerInfo(
        sha256=sha256_file(path), vocab_size=sp.get_piece_size(), unk_id=sp.unk_id(), bos_id=sp.bos_id(),
        eos_id=sp.eos_id(), pad_id=pad_id,
    )

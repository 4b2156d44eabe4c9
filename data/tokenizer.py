"""Tokenizers: train a sentencepiece model, or open an existing one (sentencepiece ``.model`` or a Hugging Face
``tokenizer.json``) behind one small interface, :class:`Tokenizer`.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data.errors import DataError

logger = logging.getLogger(__name__)

# Special ids as in Llama's tokenizer (unk 0, bos 1, eos 2) plus a real pad id, never -1.
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
# Bump when TRAINER_OPTIONS change: a prepared directory's fingerprint includes it.
TRAINER_VERSION = 1
# sentencepiece skips a training line longer than this (in UTF-8 bytes); prepare leaves such lines out and says so.
MAX_TRAINING_LINE_BYTES = 1 << 16
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
    "max_sentence_length": MAX_TRAINING_LINE_BYTES,
    "minloglevel": 2,
    **SPECIAL_IDS,
}
TOKENIZER_MODEL = "tokenizer.model"
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
            f"cannot train a tokenizer with --vocab_size {vocab_size} on this corpus: {reason} "
            "Choose a --vocab_size in the range sentencepiece gives, or supply more text."
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


# --- one interface over sentencepiece and Hugging Face `tokenizers` ---------------------------------------------
HF_TOKENIZER_FILE = "tokenizer.json"
# Names of the end-of-document token in common Hugging Face tokenizers (GPT-2/OLMo, Llama 3, Gemma, T5/Llama 2),
# tried in this order when tokenizer_config.json does not name one and no id is given.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "<eos>", "</s>", "<|im_end|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<bos>", "<s>", "<|startoftext|>")


class Tokenizer:
    """What normlab needs from a tokenizer: batched encoding, decoding, special ids, per-id byte lengths.

    ``encode_batch`` adds no special tokens; normlab appends EOS after each document itself.
    """

    kind: str
    path: Path  # the file the tokenizer was read from (hashed into meta.json)
    vocab_size: int
    bos_id: int  # -1 when the tokenizer has none
    eos_id: int
    pad_id: int
    unk_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def piece_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for, int64 [vocab_size] (special/control ids 0), for bits per byte."""
        raise NotImplementedError

    @property
    def sha256(self) -> str:
        return sha256_file(self.path)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._sp = load_processor(self.path)
        info = describe_tokenizer(self.path)
        self.vocab_size, self.bos_id, self.eos_id = info.vocab_size, info.bos_id, info.eos_id
        self.pad_id, self.unk_id = info.pad_id, info.unk_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: parallelism comes from prepare's worker processes.
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def piece_bytes(self) -> np.ndarray:
        sp, out = self._sp, np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(sp.get_piece_size()):
            if sp.is_byte(i):
                out[i] = 1
            elif not (sp.is_control(i) or sp.is_unknown(i)):
                out[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return out


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library (GPT-2, Llama 3, OLMo 2, ...)."""

    kind = "tokenizers"

    def __init__(self, path: str | Path, bos_id: int | None = None, eos_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(f"tokenizer file '{self.path}' is not a Hugging Face tokenizer.json: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = _config_tokens(self.path.parent)
        self.eos_id = self._special(eos_id, named.get("eos_token"), EOS_CANDIDATES, "EOS", "--eos_id")
        self.bos_id = self._special(bos_id, named.get("bos_token"), BOS_CANDIDATES, "BOS", None)
        pad = self._tok.token_to_id(named["pad_token"]) if named.get("pad_token") else None
        self.pad_id = pad if pad is not None else self.eos_id
        unk = self._tok.token_to_id(named["unk_token"]) if named.get("unk_token") else None
        self.unk_id = unk if unk is not None else -1

    def _special(self, given: int | None, named: str | None, candidates: tuple[str, ...], what: str,
                 flag: str | None) -> int:
        if given is not None:
            if not 0 <= given < self.vocab_size:
                raise DataError(f"{what} id {given} is outside the vocabulary of '{self.path}' "
                                f"(size {self.vocab_size})")
            return given
        for token in ((named,) if named else ()) + candidates:
            found = self._tok.token_to_id(token)
            if found is not None:
                return found
        if flag is None:
            return -1
        raise DataError(
            f"tokenizer '{self.path}' has no recognizable end-of-document token (tried {', '.join(candidates)} and "
            f"tokenizer_config.json's eos_token); pass its id with {flag}"
        )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def piece_bytes(self) -> np.ndarray:
        from tokenizers import decoders

        out = np.zeros(self.vocab_size, dtype=np.int64)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is None or token in special:
                continue
            if byte_level:  # GPT-2's byte-to-character table: one character per byte
                out[i] = sum(1 if c in unicode_to_byte else len(c.encode("utf-8")) for c in token)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):  # byte fallback piece
                out[i] = 1
            else:
                out[i] = len(token.replace("\u2581", " ").removeprefix("##").encode("utf-8"))
        return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (as in its ``encoder.py``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=False))


def _config_tokens(directory: Path) -> dict[str, str]:
    """Special token strings named in a ``tokenizer_config.json`` beside the tokenizer (if any). One whose
    ``auto_map`` names a tokenizer class of its own is refused: that tokenizer is Python code beside the files
    (which normlab never runs), so its ``tokenizer.json`` need not be what the model was trained with."""
    import json

    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    if not isinstance(raw, dict):
        return {}
    if raw.get("auto_map"):
        raise DataError(f"tokenizer '{config}' has an auto_map ({raw['auto_map']}): the tokenizer is defined by its "
                        "own Python code, which normlab never runs (trust_remote_code=False); give a tokenizer.json "
                        "or sentencepiece .model that is the tokenizer by itself")
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def tokenizer_file(path: str | Path) -> Path:
    """The file a ``--tokenizer`` argument names: a ``.model``, a ``tokenizer.json``, or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        for name in (HF_TOKENIZER_FILE, TOKENIZER_MODEL):
            if (path / name).is_file():
                return path / name
        raise DataError(f"tokenizer directory '{path}' holds neither {HF_TOKENIZER_FILE} nor {TOKENIZER_MODEL}")
    if not path.is_file():
        raise DataError(
            f"tokenizer file '{path}' does not exist; pass a sentencepiece .model, a Hugging Face tokenizer.json, "
            "or a directory holding one"
        )
    return path


def open_tokenizer(path: str | Path, bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
    """Open a sentencepiece ``.model`` or a Hugging Face ``tokenizer.json`` (or a directory holding one)."""
    path = tokenizer_file(path)
    if path.suffix == ".json":
        return HFTokenizer(path, bos_id=bos_id, eos_id=eos_id)
    if bos_id is not None or eos_id is not None:
        raise DataError(f"--bos_id/--eos_id apply to Hugging Face tokenizers; '{path}' is a sentencepiece model "
                        "whose ids are read from it")
    return SentencePieceTokenizer(path)


def reopen_args(tokenizer: Tokenizer) -> dict[str, int]:
    """The special ids to pass to :func:`open_tokenizer` to reopen ``tokenizer`` as it is (a copied
    ``tokenizer.json`` loses the ``tokenizer_config.json`` or flags its ids came from; sentencepiece models
    carry their own)."""
    if tokenizer.kind != "tokenizers":
        return {}
    return {"eos_id": tokenizer.eos_id, **({"bos_id": tokenizer.bos_id} if tokenizer.bos_id >= 0 else {})}

"""The embedded default corpus: English prose gathered at run time from the installed Python.

No third-party text is committed to the repository. Instead, every machine that runs normlab already holds
several megabytes of real English written by people: the Python language reference (``pydoc_data.topics``)
and the docstrings of the standard library and of normlab's own dependencies. We gather them in a fixed order,
keep prose paragraphs, drop repeated paragraphs (exact, ignoring case and spacing) and stop at a target size,
so the corpus is deterministic for a given set of installed versions (what :func:`default_corpus_fingerprint`
records).

Docstrings are found with a regular expression (a triple-quoted string at the start of a line) rather than
``ast.parse``: on the 2-core machines this project targets ``ast`` reads the standard library at ~1.6 MB/s,
the scan at ~15 MB/s, and the prose filter below removes what the looser match lets in.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import logging
import platform
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the gathering rules change, so a cached default corpus is rebuilt.
BUILDER_VERSION = 1
# The issue asks for at least ~5 MB; a little more gives the default job a validation split to spare.
TARGET_BYTES = 6_000_000
# normlab's own dependencies, so present wherever normlab is installed; read in this order after the stdlib.
SOURCE_PACKAGES = ("numpy", "torch", "lightning", "datasets")
# Directories whose .py files are test code or vendored code, not documentation.
_SKIP_DIRS = frozenset({"test", "tests", "testing", "idle_test", "site-packages", "dist-packages", "_vendor"})

_DOCSTRING = re.compile(r'^[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.S | re.M)
_RULE_LINE = re.compile(r"^\s*[-=~^*#]{3,}\s*$", re.M)
_CODE_PREFIXES = (">>>", "...", "$ ", "..", ":", "%", "{", "[")
MIN_WORDS = 8
MIN_LETTER_RATIO = 0.8


def default_corpus_fingerprint(target_bytes: int = TARGET_BYTES) -> dict[str, object]:
    """What the default corpus depends on, cheap to compute (no files are read).

    The corpus is a deterministic function of these values, so an existing prepared corpus with the same
    fingerprint can be reused without gathering the text again.
    """
    return {
        "kind": "default",
        "builder_version": BUILDER_VERSION,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": {name: _version(name) for name in SOURCE_PACKAGES},
        "target_bytes": target_bytes,
    }


def gather_default_corpus(target_bytes: int = TARGET_BYTES) -> list[str]:
    """Return the default corpus as a list of documents (one per topic or source file)."""
    documents: list[str] = []
    seen: set[bytes] = set()
    total = 0
    for document in _documents(seen):
        documents.append(document)
        total += len(document.encode("utf-8"))
        if total >= target_bytes:
            break
    else:
        logger.warning("default corpus: only %.1f MB of prose found (target %.1f MB)", total / 1e6, target_bytes / 1e6)
    logger.info("default corpus: %d documents, %.2f MB", len(documents), total / 1e6)
    return documents


def _documents(seen: set[bytes]) -> Iterator[str]:
    """Yield documents in a fixed order: language reference, stdlib, then each dependency."""
    from pydoc_data.topics import topics  # the text behind help('TOPIC'); part of every CPython

    for name in sorted(topics):
        # The reference's code examples are kept: they are part of the documentation's text.
        yield from _unseen(topics[name].strip().split("\n\n"), seen)
    for path in _stdlib_files() + [p for name in SOURCE_PACKAGES for p in _package_files(name)]:
        yield from _unseen([p for doc in _docstrings(path) for p in _prose_paragraphs(doc)], seen)


def _unseen(paragraphs: list[str], seen: set[bytes]) -> Iterator[str]:
    """The paragraphs not seen before, as one document (nothing if all were seen)."""
    fresh = [p for p in paragraphs if p.strip() and _first_sight(p, seen)]
    if fresh:
        yield "\n\n".join(fresh)


def _first_sight(text: str, seen: set[bytes]) -> bool:
    """True the first time a text is seen, ignoring case and whitespace (exact-duplicate removal)."""
    key = hashlib.blake2b(" ".join(text.lower().split()).encode("utf-8"), digest_size=12).digest()
    if key in seen:
        return False
    seen.add(key)
    return True


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if _SKIP_DIRS.isdisjoint(p.relative_to(root).parts))


def _package_files(dist_name: str) -> list[Path]:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        logger.info("default corpus: %s is not installed, skipped", dist_name)
        return []
    files = [f for f in dist.files or () if f.suffix == ".py" and _SKIP_DIRS.isdisjoint(f.parts)]
    return [Path(dist.locate_file(f)) for f in sorted(files, key=str)]


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _docstrings(path: Path) -> Iterator[str]:
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    for match in _DOCSTRING.finditer(source):
        yield inspect.cleandoc(match.group(2))


def _prose_paragraphs(docstring: str) -> Iterator[str]:
    """Yield the paragraphs of a docstring that read as English prose rather than code or tables."""
    for paragraph in _RULE_LINE.sub("", docstring).split("\n\n"):
        paragraph = paragraph.strip()
        if _is_prose(paragraph):
            yield paragraph


def _is_prose(paragraph: str) -> bool:
    if len(paragraph.split()) < MIN_WORDS:
        return False
    if any(line.lstrip().startswith(_CODE_PREFIXES) for line in paragraph.splitlines()):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return letters >= MIN_LETTER_RATIO * len(paragraph)

"""A tiny prepared corpus, made with data's real `prepare` (a few hundred KB of text, 320-piece vocabulary)."""
from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the cat sat on a mat while dogs ran past the quick brown fox that jumps over lazy river stones "
         "near old trees and small houses under grey skies").split()


def make_tiny_corpus(root: Path, vocab_size: int = 320) -> Path:
    from data.prepare import prepare

    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(600))
    source = root / "tiny.txt"
    source.write_text(text)
    return prepare([source], output=root / "tiny", vocab_size=vocab_size)

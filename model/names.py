"""Parameter names of a `Transformer`: which block a parameter belongs to.

The blocks are `Transformer.layers`, so a block parameter's name is `layers.<i>.<rest>` (with a prefix such as
`model.` when the Transformer is wrapped, or in Hugging Face's names). The one parser of that index.
"""
from __future__ import annotations

import re

_LAYER = re.compile(r"^(.*?layers\.)(\d+)\.(.*)$")


def split_layer(name: str) -> tuple[str, int, str] | None:
    """`(prefix, index, rest)` of a block parameter name (`"layers.3.attn.q_norm.weight"` →
    `("layers.", 3, "attn.q_norm.weight")`); None for a name outside the blocks."""
    m = _LAYER.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def layer_index(name: str) -> int | None:
    """The block index of a parameter name, or None outside the blocks."""
    parts = split_layer(name)
    return parts[1] if parts else None

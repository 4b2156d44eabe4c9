"""The one YAML reader of normlab: every YAML text normlab reads (a `-c` file and the config files it names, a sweep
spec, a run's config.yaml) goes through `load`, which refuses a text that would expand past what a config holds.

YAML anchors (`&a`) and aliases (`*a`) let a few lines stand for an exponential number of values (a "billion
laughs" text: each line lists the previous one ten times). PyYAML builds such a text as shared objects, but
whatever walks the result — jsonargparse merging a config, a comparison flattening it, a dump — expands it, and
runs out of memory; deep nesting ends in a RecursionError instead. `load` first walks the text's parse events
(iteratively: no recursion, nothing built), counting the values the text expands to and its nesting depth, and
refuses a text past either bound in one UserError naming the file. Configs hold hundreds of values; the bounds
are far above any real one.
"""
from __future__ import annotations

from typing import Any

import yaml

from training.errors import UserError

MAX_VALUES = 100_000  # scalars and collections after every alias is expanded
MAX_DEPTH = 64  # nested mappings and lists

# libyaml's loader when present (fast: a sweep reads every run's config on each state change)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def check(text: str, where: str) -> None:
    """Refuse (UserError naming `where`) a YAML text that expands to more than MAX_VALUES values or nests deeper
    than MAX_DEPTH. A syntax error is left to the loader, which reports it with its position."""
    sizes: dict[str, int] = {}  # anchor → the number of values it expands to
    stack: list[list[Any]] = [[None, 0]]  # [anchor, values so far] of each open collection; the document below
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, _OPEN):
            stack.append([event.anchor, 1])
            if len(stack) - 1 > MAX_DEPTH:
                raise UserError(f"{where}: YAML nested deeper than {MAX_DEPTH} levels; a config is a few levels "
                                "of mappings and lists: flatten it")
            continue
        if isinstance(event, _CLOSE):
            anchor, size = stack.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, sizes.get(event.anchor, 1)
        else:  # stream and document boundaries
            continue
        if anchor is not None:
            sizes[anchor] = size
        stack[-1][1] += size
        if stack[-1][1] > MAX_VALUES:
            raise UserError(f"{where}: its YAML aliases (`*name` repeating an `&name` anchor) expand to more than "
                            f"{MAX_VALUES:,} values, far beyond any config (an alias bomb?); write the values out, "
                            "or repeat fewer of them")


def load(text: str, where: str) -> Any:
    """`text` parsed as YAML (PyYAML's safe loader: plain data, no tags that build objects), after `check`.
    Raises yaml.YAMLError for a text that is not YAML, as yaml.safe_load does."""
    check(text, where)
    return yaml.load(text, Loader=_LOADER)

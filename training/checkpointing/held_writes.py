"""`HoldingCheckpointEngine`: DeepSpeed's default checkpoint engine (one `torch.save` per file) whose file writes go
through a holder while a checkpoint save is under way — so a rank whose write fails keeps going through the save's
collectives, and every rank raises the gathered error afterwards (training/checkpointing/save.py).

`training.strategy.DeepSpeed` installs it on its engine once the engine is built (DeepSpeed 0.19 picks its
checkpoint engine from the config and has no hook for one of one's own: catalogued in training/compat.py), and
routes the engine's one other checkpoint write, the recovery-script copy, through it too. Imported only under
DeepSpeed (it imports DeepSpeed).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

Hold = Callable[[Callable[..., Any]], Callable[..., Any]]  # a write → the same write, its error held


class HoldingCheckpointEngine(TorchCheckpointEngine):
    """`TorchCheckpointEngine` whose `save` and `makedirs` go through `hold` inside `holding(hold)`."""

    def __init__(self, zipfile_serialization: bool) -> None:
        super().__init__(None)
        self.zipfile_serialization = zipfile_serialization  # as the engine it replaces was configured
        self.hold: Hold | None = None

    def through(self, write: Callable[..., Any]) -> Callable[..., Any]:
        """`write` as the save under way holds it (unchanged outside one)."""
        return self.hold(write) if self.hold is not None else write

    def save(self, state_dict: Any, path: str) -> None:
        self.through(super().save)(state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.through(super().makedirs)(path, exist_ok=exist_ok)

    @contextmanager
    def holding(self, hold: Hold) -> Iterator[None]:
        self.hold = hold
        try:
            yield
        finally:
            self.hold = None

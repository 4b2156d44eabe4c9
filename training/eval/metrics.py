"""The one definition of held-out numbers, shared by validation inside `normlab fit` (`LitLM`) and
`normlab evaluate` (`training/eval/heldout.py`): the loss of a batch, and loss / perplexity / bits per byte from
sums over batches.

Both paths score a batch exactly as training does (`batch_loss`: the model's chunked LM-head loss, with the
batch's `position_ids` under document masking), and both reduce with `LossTotals`: token-weighted sums, so the
mean is exact whatever the batch sizes, and `perplexity` is exactly `exp(loss)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn


def split_batch(batch: Tensor | dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(tokens [B, T+1], the inputs' position_ids [B, T] or None) of a batch: a token tensor, or with
    `data.document_mask` the datamodule's dict `{"tokens", "position_ids"}`, both [B, T+1] (the model then masks
    attention to each document)."""
    if isinstance(batch, dict):
        return batch["tokens"], batch["position_ids"][:, :-1]
    return batch, None


def batch_loss(model: nn.Module, batch: Tensor | dict[str, Tensor]) -> Tensor:
    """Mean next-token cross-entropy of a batch [B, T+1] (inputs batch[:, :-1], targets batch[:, 1:]) under the
    `model.Transformer`'s chunked LM-head loss: the [B, T, vocab] logits are never materialized."""
    tokens, positions = split_batch(batch)
    return model(tokens[:, :-1], targets=tokens[:, 1:], position_ids=positions)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows above ~709


def bits_per_byte(loss: float, tokens: int | float, nbytes: int | float) -> float:
    """Nats per token → bits per UTF-8 byte of the scored targets (tokenizer-independent)."""
    return loss / math.log(2) * tokens / max(nbytes, 1)


@dataclass
class LossTotals:
    """Running sums over scored batches: Σ loss·tokens (nats), target tokens, target UTF-8 bytes."""

    loss_sum: float = 0.0
    tokens: int = 0
    nbytes: int = 0

    def add(self, loss_sum: float, tokens: int, nbytes: int = 0) -> None:
        self.loss_sum += loss_sum
        self.tokens += tokens
        self.nbytes += nbytes

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)

    def compute(self) -> dict[str, float]:
        loss = self.loss
        return {"loss": loss, "perplexity": perplexity(loss),
                "bits_per_byte": bits_per_byte(loss, self.tokens, self.nbytes)}

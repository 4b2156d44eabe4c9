"""The one definition of held-out numbers, shared by validation inside `normlab fit` (`LitLM`) and
`normlab evaluate` (`training/eval/heldout.py`): the loss of a batch, the accumulator, and the tag names.

Both paths score a batch exactly as training does (`batch_loss`: the model's chunked LM-head loss, with the
batch's `position_ids` under document masking), and both accumulate into `LossTotals`: token-weighted sums, so the
mean is exact whatever the batch sizes, and `perplexity` is exactly `exp(loss)`.

Tags (docs/monitoring.md): `<prefix>/<short name>` with the short names of METRICS — `val/loss|ppl|bpb` (the data's
own validation set), `val/<set>/...` (a mixture's source, a named held-out set), `test/...`, and
`eval/<set>/...` from `normlab evaluate`. `tags` is the only place they are spelled.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
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


METRICS = {"loss": "loss", "perplexity": "ppl", "bits_per_byte": "bpb"}  # result key → tag name


def tag(prefix: str, metric: str) -> str:
    """The tag of one held-out number (`metric`, a key of METRICS) under `prefix` (`val`, `val/web`, `eval/val`)."""
    return f"{prefix}/{METRICS[metric]}"


def tags(prefix: str, values: dict[str, float]) -> dict[str, float]:
    """{tag: value} of the held-out numbers among `values` (a `LossTotals.compute()` result or a saved one)."""
    return {tag(prefix, metric): values[metric] for metric in METRICS if metric in values}


def mixture(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """The held-out numbers of a mixture from its sources' [(weight, numbers)]: loss and bits per byte are the
    weighted means (as the mixture weighs its sources), perplexity exp(loss). One source: its numbers."""
    total = sum(w for w, _ in parts)
    out = {"loss": sum(w * x["loss"] for w, x in parts) / total}
    out["perplexity"] = perplexity(out["loss"])
    if all("bits_per_byte" in x for _, x in parts):
        out["bits_per_byte"] = sum(w * x["bits_per_byte"] for w, x in parts) / total
    return out


class LossTotals:
    """Running sums over scored batches: Σ loss·tokens (nats), target tokens, target UTF-8 bytes — one float64
    tensor on the batches' device, so adding a batch needs no host sync, and the totals of several sets reduce
    across ranks in one collective (`reduce_all`)."""

    def __init__(self, loss_sum: float = 0.0, tokens: int = 0, nbytes: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.sums = torch.tensor([loss_sum, tokens, nbytes], dtype=torch.float64, device=device)

    def add(self, loss_sum: Tensor | float, tokens: Tensor | int, nbytes: Tensor | int = 0) -> None:
        self.sums += torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.sums.device)
                                  for x in (loss_sum, tokens, nbytes)])

    def add_batch(self, mean_loss: Tensor, targets: Tensor, piece_bytes: Tensor | None = None) -> None:
        """One scored batch: its mean loss over `targets`, and (with `piece_bytes`, bytes per token id, on the
        targets' device) the UTF-8 bytes those targets stand for."""
        nbytes = piece_bytes[targets].sum() if piece_bytes is not None else 0
        self.add(mean_loss.detach().double() * targets.numel(), targets.numel(), nbytes)

    @staticmethod
    def reduce_all(totals: list[LossTotals], reduce: Callable[[Tensor], Tensor]) -> list[LossTotals]:
        """The totals of every set summed over ranks by `reduce` (e.g. the strategy's sum), in one call."""
        summed = reduce(torch.stack([t.sums for t in totals]))
        out = []
        for row in summed:
            reduced = LossTotals(device=row.device)
            reduced.sums = row.clone()
            out.append(reduced)
        return out

    @property
    def tokens(self) -> int:
        return int(self.sums[1].item())

    @property
    def nbytes(self) -> int:
        return int(self.sums[2].item())

    @property
    def loss(self) -> float:
        loss_sum, tokens, _ = self.sums.tolist()
        return loss_sum / max(tokens, 1)

    def compute(self) -> dict[str, float]:
        """loss, perplexity and (when bytes were counted) bits_per_byte (one host sync)."""
        loss_sum, tokens, nbytes = self.sums.tolist()
        loss = loss_sum / max(tokens, 1)
        out = {"loss": loss, "perplexity": perplexity(loss)}
        if nbytes > 0:
            out["bits_per_byte"] = bits_per_byte(loss, tokens, nbytes)
        return out

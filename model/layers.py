"""Linear and embedding layers that initialize themselves from a given std inside their own __init__.

Initializing in the leaf's constructor (not in a pass over the finished model) is what keeps init correct
under DeepSpeed's `zero.Init`, which partitions each module's parameters as soon as its __init__ returns.
`reset_parameters` re-draws them, which is how `init_weights` initializes a model built on the meta device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, std: float = 0.02) -> None:
        super().__init__()
        self.in_features, self.out_features, self.std = in_features, out_features, std
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.std == 0.0:
            nn.init.zeros_(self.weight)
        else:
            nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}→{self.out_features}, bias={self.bias is not None}, std={self.std:.4g}"


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, std: float = 0.02) -> None:
        super().__init__()
        self.std = std
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)

"""Speed and memory options applied to a built model from outside (the model code stays plain).

- `enable_activation_checkpointing`: keep only each block's input during forward and recompute the block in
  backward — activation memory per token drops from ~all intermediates of every block to one stream per block.
- `compile_blocks`: `torch.compile` each block separately ("regional" compilation, as torchtitan does): one
  graph per block shape instead of the whole model, so compile time stays small and the norms, RoPE and SwiGLU
  elementwise work fuse. Works with the custom norm ops (they register fake kernels).
"""
from __future__ import annotations

import torch

from model.transformer import Transformer


def enable_activation_checkpointing(model: Transformer, enabled: bool = True) -> Transformer:
    model.activation_checkpointing = enabled
    return model


def compile_blocks(model: Transformer, **compile_kwargs) -> Transformer:
    """Replace each block's hot-path method by a compiled version (idempotent)."""
    for layer in model.layers:
        if not getattr(layer, "_normlab_compiled", False):
            layer.forward_deferred = torch.compile(layer.forward_deferred, **compile_kwargs)
            layer._normlab_compiled = True
    return model

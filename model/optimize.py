"""Speed and memory options applied to a built model from outside (the model code stays plain).

- `enable_activation_checkpointing`: keep only each block's input during forward and recompute the block in
  backward — activation memory per token drops from ~all intermediates of every block to one stream per block.
- `compile_blocks`: compile each block as a module (`nn.Module.compile`: "regional" compilation, as torchtitan
  does): one graph per block shape instead of the whole model, so compile time stays small and the norms, RoPE
  and SwiGLU elementwise work fuse. Works with the custom norm ops (they register fake kernels). In place, so
  parameter names and the state dict do not change, and a block is still called through `__call__`: forward
  hooks on a block fire. (Hooks added *inside* a block after compiling are not guarded by Dynamo; the probes
  therefore run the blocks eagerly while they are attached, see model/probes.py.)
"""
from __future__ import annotations

from model.transformer import Transformer


def enable_activation_checkpointing(model: Transformer, enabled: bool = True) -> Transformer:
    model.activation_checkpointing = enabled
    return model


def compile_blocks(model: Transformer, **compile_kwargs) -> Transformer:
    """Compile each block in place with `torch.compile(**compile_kwargs)`; compiling again recompiles."""
    for layer in model.layers:
        layer.compile(**compile_kwargs)
    return model

#!/usr/bin/env bash
# Multi-GPU / multi-node training with torchrun (one torchrun per node).
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node001 scripts/launch_torchrun.sh [normlab fit options...]   # on node001
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node001 scripts/launch_torchrun.sh [normlab fit options...]   # on node002
#
# Single node: `scripts/launch_torchrun.sh -c configs/gpu_125m.yaml` (NNODES=1, all local GPUs).
# NPROC_PER_NODE defaults to the number of visible GPUs (2 processes on a CPU-only machine, for trying it out;
# STRATEGY and ACCELERATOR can be overridden the same way). Lightning detects torchrun's environment (TorchElastic);
# devices and num_nodes are passed explicitly because Lightning cannot infer them under torchrun. With several
# nodes, keep the run directory on a filesystem they all share (every rank writes its checkpoint shards into it).
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
NPROC_PER_NODE=${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m training.cli fit --trainer.strategy "${STRATEGY:-zero2}" --trainer.accelerator "${ACCELERATOR:-auto}" \
  --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC_PER_NODE" --ckpt_path last "$@"

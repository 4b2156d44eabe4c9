#!/usr/bin/env bash
# Training under the `deepspeed` launcher: one node, or several listed in a hostfile.
#
#   scripts/launch_deepspeed.sh [normlab fit options...]                         # this node, all its GPUs
#   scripts/launch_deepspeed.sh --hostfile HOSTFILE [normlab fit options...]     # the nodes in HOSTFILE
#   scripts/launch_deepspeed.sh --hostfile scripts/hostfile.example -c configs/gpu_125m.yaml --name my-run
#
# With a hostfile, run it on the first host listed: the launcher ssh-es (pdsh) into every host, sets RANK,
# LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and CROSS_RANK (which normlab maps to Lightning's NODE_RANK) and
# starts `slots` processes per host. num_nodes and devices must match, so they are derived here. The run
# directory must be on a filesystem all nodes share (every rank writes its checkpoint shards into it).
# Re-running the same command resumes from the newest complete checkpoint (--ckpt_path last).
# Env: STRATEGY (zero2), MASTER_PORT (29500), NPROC (single node: processes; default all GPUs, 2 on a CPU).
set -euo pipefail
LAUNCH=(--master_port "${MASTER_PORT:-29500}")
if [ "${1:-}" = "--hostfile" ]; then
  HOSTFILE=${2:?--hostfile needs a file}
  shift 2
  HOSTS=$(grep -E '^[^#[:space:]]+[[:space:]]+slots=' "$HOSTFILE")
  NODES=$(echo "$HOSTS" | wc -l)
  DEVICES=$(echo "$HOSTS" | head -1 | sed -E 's/.*slots=([0-9]+).*/\1/')
  LAUNCH+=(--hostfile "$HOSTFILE" --master_addr "$(echo "$HOSTS" | head -1 | awk '{print $1}')")
else
  GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
  NODES=1
  DEVICES=${NPROC:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
  LAUNCH+=(--num_gpus "$DEVICES")  # on a CPU-only machine: the number of processes
fi
# --no_local_rank: normlab reads LOCAL_RANK from the environment; it takes no --local_rank argument.
exec deepspeed "${LAUNCH[@]}" --no_local_rank --module training.cli \
  fit --trainer.strategy "${STRATEGY:-zero2}" --trainer.num_nodes "$NODES" --trainer.devices "$DEVICES" \
  --ckpt_path last "$@"

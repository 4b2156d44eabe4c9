#!/usr/bin/env bash
# One prepared GPU check of the training stack (issue 4): the paths a CPU cannot run.
#   - `normlab fit` on one GPU with the automatic precision (bf16-mixed), default strategy;
#   - Lightning's stock DeepSpeed strategy (ZeRO-2 and ZeRO-3) on CUDA through `--trainer.strategy zeroN`;
#   - resume of the ZeRO-2 run with --ckpt_path last; consolidation of the ZeRO-3 checkpoint;
#   - throughput / MFU against the GPU's datasheet peak;
#   - fp16 (16-mixed) with and without ZeRO-2 under the default guard (abort): the loss scaler's routine early
#     overflows must be logged as guard/scaler_overflows, not abort the run (CPU cannot run fp16);
#   - `normlab fit` itself on configs/gpu_125m.yaml, one GPU: eager, `--model.compile true`,
#     `--model.activation_checkpointing true` and ZeRO-2 — tokens/s, MFU and peak memory as fit logs them
#     (throughput/*), the numbers docs/strategies.md waits for; and the GPU-only tests (fused AdamW).
#
#   DATA=data_cache/default OUT=/some/dir bash scripts/gpu_check_training.sh      (~6-8 minutes on one H200)
#
# Every step logs to $OUT/<step>.txt; $OUT/summary.txt collects exit codes and the logged numbers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
DATA="${DATA:-data_cache/default}"
RUNS="${RUNS:-/tmp/normlab_gpu_runs}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh  # deepspeed, jsonargparse, datasets: carried wheels (bash scripts/gpu_wheels.sh first)
: > "$OUT/summary.txt"

step() {  # step NAME TIMEOUT CMD...
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS status=0
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1 || status=$?
  echo "$name: exit $status after $((SECONDS - start))s" >> "$OUT/summary.txt"
  [ "$status" -eq 0 ] || tail -n 30 "$OUT/$name.txt"
}
FIT=("$PY" -m training.cli fit --data.path "$DATA" --runs_dir "$RUNS" --trainer.enable_progress_bar false)

# A ~50M-parameter model, seq 512, batch 16: big enough for the GPU to matter, seconds per run.
MODEL=(--model.dim 512 --model.n_layers 8 --model.n_heads 8 --data.seq_len 512 --data.batch_size 16
       --model.max_seq_len 512 --trainer.log_every_n_steps 5 --trainer.val_check_interval 20)
step env 60 "$PY" -c "import torch, lightning, deepspeed; print(torch.__version__, lightning.__version__, deepspeed.__version__, torch.cuda.get_device_name())"
step fit_default 180 "${FIT[@]}" "${MODEL[@]}" --name default --trainer.max_steps 60 --checkpoint.every_n_steps 30
step zero2_part 180 "${FIT[@]}" "${MODEL[@]}" --name zero2 --trainer.strategy zero2 --trainer.devices 1 --trainer.max_steps 40 --checkpoint.every_n_steps 20 --optim.decay_steps 60
step zero2_resume 180 "${FIT[@]}" "${MODEL[@]}" --name zero2 --trainer.strategy zero2 --trainer.devices 1 --trainer.max_steps 60 --checkpoint.every_n_steps 20 --optim.decay_steps 60 --ckpt_path last
step zero3 180 "${FIT[@]}" "${MODEL[@]}" --name zero3 --trainer.strategy zero3 --trainer.devices 1 --trainer.max_steps 40 --checkpoint.every_n_steps 20 --optim.decay_steps 60
step fp16 180 "${FIT[@]}" "${MODEL[@]}" --name fp16 --trainer.precision 16-mixed --trainer.max_steps 30 --checkpoint.every_n_steps 0
step fp16_zero2 180 "${FIT[@]}" "${MODEL[@]}" --name fp16_zero2 --trainer.precision 16-mixed --trainer.strategy zero2 --trainer.devices 1 --trainer.max_steps 30 --checkpoint.every_n_steps 0
# normlab fit on the 125M config (seq 1024, batch 16), 60 updates: throughput is averaged over the last 10.
M125=("$PY" -m training.cli fit -c configs/gpu_125m.yaml --data.path "$DATA" --runs_dir "$RUNS" --trainer.devices 1
      --trainer.enable_progress_bar false --trainer.max_steps 60 --trainer.val_check_interval 1000
      --checkpoint.every_n_steps 0 --optim.warmup_steps 10)
step fit125_eager 300 "${M125[@]}" --name fit125_eager
step fit125_compile 420 "${M125[@]}" --name fit125_compile --model.compile true
step fit125_actckpt 300 "${M125[@]}" --name fit125_actckpt --model.activation_checkpointing true
step fit125_zero2 300 "${M125[@]}" --name fit125_zero2 --trainer.strategy zero2
step gpu_tests 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_host_syncs.py -k fused
step report 120 "$PY" - "$RUNS" <<'PYEOF'
import json, sys
from pathlib import Path
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tests.helpers.runs import consolidated_state_dict
from model import ModelConfig, Transformer
runs = Path(sys.argv[1])
for name in ("default", "zero2", "zero3", "fp16", "fp16_zero2", "fit125_eager", "fit125_compile", "fit125_actckpt",
             "fit125_zero2"):
    if not (runs / name).is_dir():
        print(name, "did not run"); continue
    acc = EventAccumulator(str(runs / name), size_guidance={"scalars": 0}); acc.Reload()
    tags = acc.Tags()["scalars"]
    row = {t: [(e.step, round(e.value, 4)) for e in acc.Scalars(t)][-3:] for t in
           ("train/loss", "val/loss", "val/ppl", "throughput/tokens_per_sec", "throughput/mfu",
            "throughput/peak_tflops", "throughput/max_memory_gb", "guard/scaler_overflows", "guard/skipped_steps")
           if t in tags}
    steps = [e.step for e in acc.Scalars("train/loss")]
    row["train/loss steps unique"] = len(steps) == len(set(steps))
    row["manifests"] = [json.loads(p.read_text()) for p in sorted((runs / name / "checkpoints").glob("*/manifest.json"))]
    print(name, json.dumps(row, indent=1))
ckpt = sorted((runs / "zero3" / "checkpoints").glob("step-*"))[-1]
state = consolidated_state_dict(ckpt, Path("/tmp"))
model = Transformer(ModelConfig(**json.loads((ckpt / "model_config.json").read_text())))
model.load_state_dict(state, strict=True)
print("zero3 consolidated and loaded:", ckpt.name, sum(v.numel() for v in state.values()), "parameters")
PYEOF
cat "$OUT/summary.txt" "$OUT/report.txt"

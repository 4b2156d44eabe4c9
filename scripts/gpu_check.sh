#!/usr/bin/env bash
# One prepared check for a lent GPU: environment, kernel tests on CUDA, norm benchmark.
#
#   OUT=/some/dir bash scripts/gpu_check.sh        # results: $OUT/*.txt (default OUT: ./gpu_check_out)
#
# The GPU machine has no network: it runs the checkout with the machine's own torch and triton (PYTHONPATH),
# plus the wheels carried in ./.whl (scripts/gpu_wheels.sh; installed by scripts/gpu_env.sh).
# Budget: ~13 minutes in all, more than one device call may run (10 min): split it with STEPS, a space-separated
# list of step names to run (default: all), e.g. STEPS="norms_env profile_350m loss_bench".
# Each step has its own time limit and its own log ($OUT/<step>.txt); a
# failing step is recorded in $OUT/summary.txt (appended to) and the next step still runs; the exit status is 1
# if any step failed.
# To add a step, append `step <name> <timeout-s> <command...>` in the marked place at the bottom.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh  # the checkout on PYTHONPATH (no install), carried wheels in a temporary target
unset TRITON_INTERPRET NORMLAB_KERNELS  # compiled GPU kernels, and no backend override
FAILED=0
echo "=== scripts/gpu_check.sh, $(date -u +%FT%TZ)" >> "$OUT/summary.txt"  # appends: OUT may be shared

# step NAME TIMEOUT_S CMD...: runs CMD under a time limit, logs to $OUT/NAME.txt, records the exit status.
step() {
  local name="$1" limit="$2"
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
  local start=$SECONDS status=0
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1 || status=$?
  echo "    -> exit $status after $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
  tail -n 40 "$OUT/$name.txt"
  if [ "$status" -ne 0 ]; then FAILED=1; fi
}

env_info() {
  nvidia-smi || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as error:
    print("triton: not importable:", error)
EOF
  "$PY" -m pip list 2>/dev/null | grep -i -E '^(torch|triton|liger[-_]kernel|pytest|numpy) ' || true
}
export -f env_info

# ---- 1. environment --------------------------------------------------------------------------------
step norms_env 30 bash -c env_info

# ---- 3. kernel correctness on CUDA (interpreter cases skip on a GPU machine; the CPU C++ kernel runs too) --
step norms_kernel_tests 110 "$PY" -m pytest -q -ra --noconftest -p no:cacheprovider \
  tests/test_kernels_accuracy.py tests/test_kernels_dispatch.py tests/test_kernels_model.py

# ---- 4. norm benchmark: bandwidth vs a device copy; vs torch eager, torch.compile, Liger ---------------
step norms_bench_gpu 120 "$PY" scripts/bench_norms.py gpu --rows 32768 --hidden 1024 2048 4096 8192 --rep-ms 50

# ---- 5. training throughput and MFU: a ~370M-parameter Llama-style model, bf16-mixed, one H200 ----------
# Eager first (a floor that needs no compiler), then regional torch.compile of each block.
TRAIN=("$PY" scripts/bench_train.py --device cuda --dtype bfloat16 --dim 1024 --layers 24 --heads 16 \
       --seq 2048 --batch 8 --vocab 32768 --only-normlab)
step train_350m_eager 75 "${TRAIN[@]}" --train-seconds 25
step train_350m_compile 165 "${TRAIN[@]}" --train-seconds 45 --compile

# ---- 6. where the 371M step goes (matmul / attention / norm / loss / optimizer / idle), and the LM-head loss:
# normlab's chunked loss vs materialized logits vs Liger's fused linear cross-entropy (carried wheel) -------
step profile_350m 150 "$PY" scripts/profile_train.py --device cuda --dtype bfloat16 --dim 1024 --layers 24 \
  --heads 16 --seq 2048 --batch 8 --vocab 32768 --compile --steps 5 --out "$OUT/profile_350m_table.txt"
step loss_bench 60 "$PY" scripts/bench_loss.py --device cuda --dtype bfloat16 --tokens 16384 --dim 1024 \
  --vocab 32768

# ---- 7. document masking on CUDA: the compiled flex-attention path against per-document runs (it skips on CPU),
# and its step cost against plain causal SDPA and the dense-mask SDPA fallback, at the 371M shape ----------------
step docmask_cuda 150 bash -c "\"$PY\" -m pytest -q -ra -p no:cacheprovider tests/test_docmask_model.py && \
  \"$PY\" scripts/bench_docmask.py --device cuda --dtype bfloat16 --dim 1024 --layers 24 --heads 16 --seq 2048 \
  --batch 8 --vocab 32768"

echo "=== done: failed=$FAILED; results in $OUT" | tee -a "$OUT/summary.txt"
# The device tool brings back at most 8 files: with PACK=1 the step logs travel as one archive beside summary.txt.
if [ "${PACK:-0}" = 1 ]; then
  (cd "$OUT" && find . -maxdepth 1 -name '*.txt' ! -name summary.txt -printf '%f\n' | tar czf logs.tgz -T - \
    && find . -maxdepth 1 -name '*.txt' ! -name summary.txt -delete)
fi
exit "$FAILED"

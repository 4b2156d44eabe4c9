#!/usr/bin/env bash
# Prepare, on a machine with network, the wheels that the (offline) GPU check machine lacks, into ./.whl/.
#
#   bash scripts/gpu_wheels.sh                  # ~10 s, ~7.5 MB
#   WITH_PYARROW=1 bash scripts/gpu_wheels.sh   # + pyarrow (55 MB: near the 64 MiB a GPU call may carry)
#
# The GPU machine has CUDA torch, triton, lightning, numpy, pandas, tensorboard, sentencepiece, safetensors,
# tokenizers and transformers, but no network and none of: deepspeed (and its pydantic/hjson), jsonargparse (and
# the [signatures] extras), datasets (and dill/multiprocess; it needs pyarrow>=24: the image's pyarrow is used
# unless WITH_PYARROW=1 — training itself reads prepared token files and needs neither),
# liger-kernel (the benchmark baseline). `scripts/gpu_env.sh`, sourced by both GPU check scripts, installs
# whatever is in ./.whl into a temporary target there. Wheels are for CPython 3.12 on x86-64 (the GPU image's
# python); deepspeed ships only a source archive, so its pure-Python wheel is built here (no ops pre-compiled;
# DeepSpeed JIT-builds the ones it needs).
set -euo pipefail
cd "$(dirname "$0")/.."
WHL="${WHL:-.whl}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
mkdir -p "$WHL"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PACKAGES=(
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  liger-kernel==0.8.5
)
if [ "${WITH_PYARROW:-0}" = 1 ]; then PACKAGES+=(pyarrow==26.0.1); fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  "${PLATFORMS[@]}" -d "$WHL" "${PACKAGES[@]}"
python3 -m pip wheel -q --no-deps -w "$WHL" deepspeed==0.19.8
du -sh "$WHL"
ls "$WHL"

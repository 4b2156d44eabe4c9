# Sourced by scripts/gpu_check*.sh: make the checkout importable and install the carried wheels (./.whl, made by
# scripts/gpu_wheels.sh) into a temporary target, since the GPU machine has no network. Without ./.whl nothing is
# installed, and steps that need deepspeed/jsonargparse/datasets fail with their import error in their own log.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PY
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE="${GPU_SITE:-/tmp/normlab_site}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE"  # before site-packages: the carried versions win over the image's
fi

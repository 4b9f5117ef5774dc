# Sourced by the device-call scripts: output folder, carried wheels, PYTHONPATH, and a `tt` shorthand.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
tt() { python3 -m tracetrain.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

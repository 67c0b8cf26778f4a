#!/usr/bin/env bash
# GPU check for the Triton attention kernels, run from anywhere on a CUDA machine (about 6-8 minutes
# on an H200, most of it Triton compiling and autotuning):
#   1. the kernel tests COMPILED (no interpreter), with one configuration per kernel
#      (AUTOSHARD_TRITON_AUTOTUNE=0) and every candidate configuration checked once;
#   2. benchmarks/kernels.py: TFLOP/s vs torch SDPA flash, autotuned.
# Prints everything; exits non-zero when a step fails. Uses the image's python3 (or $PYTHON) and the
# repository on PYTHONPATH, so nothing needs installing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())" || exit 1

status=0
echo "== kernel tests (compiled, CUDA) =="
workers=$("$PY" -c "import importlib.util as u; print('-n 4' if u.find_spec('xdist') else '')")
SECONDS=0
AUTOSHARD_TRITON_AUTOTUNE=0 timeout 330 "$PY" -m pytest -q -p no:cacheprovider $workers tests/kernels || status=1
echo "tests: ${SECONDS}s"

echo "== benchmark =="
SECONDS=0
timeout 420 "$PY" benchmarks/kernels.py || status=1
echo "benchmark: ${SECONDS}s"
exit $status

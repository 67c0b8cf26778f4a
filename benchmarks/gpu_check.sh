#!/usr/bin/env bash
# GPU check for the Triton attention kernels, to run on a CUDA machine (an H200: about 6-8 minutes,
# most of it Triton compiling and autotuning):
#   1. the kernel tests COMPILED (no interpreter) on CUDA, with one configuration per kernel
#      (AUTOSHARD_TRITON_AUTOTUNE=0) except the test that forces every candidate configuration;
#   2. benchmarks/kernel_speed.py: TFLOP/s against torch SDPA flash, autotuned, plus the output difference;
#   3. the offloaded checkpoints' copies on CUDA (tests/runtime/test_offload.py: pinned, their own stream,
#      double-buffered backward holding one more region input).
# Prints everything; exits non-zero when a step fails. Uses the machine's python3 (or $PYTHON) with
# the repository on PYTHONPATH, so nothing needs installing. Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())" || exit 1

status=0
echo "== kernel tests (compiled, CUDA) =="
# Compilation dominates: spread the tests over processes when pytest-xdist is there.
workers=$("$PY" -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
SECONDS=0
AUTOSHARD_TRITON_AUTOTUNE=0 timeout 240 "$PY" -m pytest -q -p no:cacheprovider $workers tests/kernels || status=1
echo "tests: ${SECONDS}s"

echo "== benchmark =="
SECONDS=0
timeout 330 "$PY" benchmarks/kernel_speed.py || status=1
echo "benchmark: ${SECONDS}s"

echo "== offload (CUDA) =="
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_offload.py || status=1
exit $status

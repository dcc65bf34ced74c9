#!/usr/bin/env bash
# GPU smoke, on a machine with CUDA, from the repository root: the tests marked `gpu` (the Megatron backend on
# the GPU, NCCL, against the torch backend), then benchmarks/gpu_smoke.py (both backends' step time and peak
# memory on the demo's model and a Qwen3 tiny model). Extra arguments go to gpu_smoke.py.
#   bash benchmarks/gpu_smoke.sh [--steps 5]        (PYTHON=... to choose the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_smoke: no CUDA device visible to $PYTHON"; exit 2; }
# Only the modules that hold gpu tests: collecting the whole suite imports the CPU-side stack (Ray, Prefect).
mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
"$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rs "${files[@]}"
tests=$?
"$PYTHON" benchmarks/gpu_smoke.py "$@"
bench=$?
echo "gpu_smoke: gpu tests exit $tests, benchmark exit $bench"
exit $(( tests != 0 || bench != 0 ))

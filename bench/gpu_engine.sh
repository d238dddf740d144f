#!/usr/bin/env bash
# The engine's GPU checks and benchmark in one device call (see docs/benchmarks.md):
#   GPU tests (engine on CUDA vs transformers + PEFT), then bench/engine.py.
# Usage on the GPU machine, from the repo root: bash bench/gpu_engine.sh [bench/engine.py args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lorafleet-out}
mkdir -p "$OUT"
# The image has torch/triton/transformers/peft but no network: install the project alone, or shim it.
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  shim=/tmp/lorafleet-shim/lorafleet
  rm -rf "$shim" && mkdir -p "$shim" && cp common/*.py "$shim"/
  for d in worker kernels router operator; do ln -s "$PWD/$d" "$shim/$d"; done
  export PYTHONPATH=/tmp/lorafleet-shim
fi
python3 -c "import lorafleet.worker.engine, lorafleet.kernels.triton_lora" || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 240 python3 -m pytest -q -m gpu tests/worker/test_engine_gpu.py tests/worker/test_cuda_graphs.py tests/kernels -p no:cacheprovider -rf \
  2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -n 25
timeout 420 python3 -m bench.engine --out "$OUT/engine-h200.json" "$@" 2>&1 | tee "$OUT/engine_bench.log" | tail -n 30

#!/usr/bin/env bash
# The engine's GPU checks and benchmarks in one device call (~6 min; see docs/benchmarks.md):
#   1. every GPU test (`pytest -m gpu tests/kernels tests/worker`): kernels vs their torch
#      references, CUDA-graph replay vs eager, the engine vs transformers + PEFT, the load path,
#      and, with the wheels of bench/gpu_wheels.sh carried, the HTTP suites with the worker on CUDA;
#   2. bench/engine.py (throughput, per-step breakdown, TTFT, peers, cold adapter loads), with any
#      extra arguments given to this script appended;
#   3. bench/prefill.py (a burst of fresh prompts; one prompt joining a running batch);
#   4. bench/kernels.py --quick (the LoRA kernels against the memory floor, PDL on/off).
# Usage on the GPU machine, from the repo root: bash bench/gpu_engine.sh [bench/engine.py args...]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" || exit 1
# --continue-on-collection-errors: the image lacks FastAPI, uvicorn and openai, which the HTTP test
# files import, unless bench/gpu_wheels.sh's .whl came along (then the HTTP suites on CUDA run too).
timeout 300 python3 -m pytest -q -m gpu tests/kernels tests/worker -p no:cacheprovider -rf --continue-on-collection-errors \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
# If PDL broke graph capture, measure without it (and say so in the log).
if grep -q "FAILED.*new_metadata\[True\]" "$OUT/gpu_tests.log"; then export LORAFLEET_PDL=0; echo "PDL OFF"; fi
timeout "${ENGINE_TIMEOUT:-240}" python3 -m bench.engine --adapters 1,8,64 --prompt-lens 128 --new-tokens 64 --breakdown 0,8,64 \
  --peers --peft-adapters 8 --adapter-load 5 --out "$OUT/engine-h200.json" "$@" \
  2>&1 | tee "$OUT/engine.log" | grep -v "^\s*$" | tail -n 45
timeout 100 python3 -m bench.prefill --out "$OUT/prefill-cuda.json" 2>&1 | tee "$OUT/prefill.log" | tail -n 6
timeout 80 python3 bench/kernels.py --quick --no-baselines --out "$OUT/kernels-quick.json" \
  2>&1 | tee "$OUT/kernels.log" | tail -n 28

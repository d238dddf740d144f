#!/usr/bin/env bash
# Issue 50's model families on one GPU in one device call (~5 min on an H100):
#   1. their GPU tests: every family on CUDA (fp32, the engine's CUDA defaults) against transformers
#      + PEFT, DoRA adapters in a batch with LoRA ones and the base, the DoRA epilogue kernel, and
#      the paged kernel's windows and soft-capping in bf16 at Gemma 2 9B's shape;
#   2. bench/engine_models.py: decode tokens/s of Llama (seed shape), Qwen3 and Gemma 2 at ~8B
#      shapes, batch 64, base and 64 rank-16 adapters (Llama's also with 64 DoRA adapters)
#      -> $OUT/engine-models-<gpu>.json.
# Usage on the GPU machine, from the repo root: bash bench/gpu_models.sh [bench/engine_models.py args...]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" || exit 1
timeout 120 python3 -m pytest -q tests/kernels/test_dora_epilogue.py -p no:cacheprovider 2>&1 | tail -n 2
timeout 240 python3 -m pytest -q -m gpu tests/worker/test_model_families.py tests/worker/test_dora.py \
  tests/kernels/test_paged_attention_window.py \
  -p no:cacheprovider -rf -s 2>&1 | tee "$OUT/gpu_models_tests.log" | grep -E "Δ|passed|failed|FAILED|Error" | tail -n 20
timeout "${MODELS_TIMEOUT:-300}" python3 -m bench.engine_models --out-dir "$OUT" "$@" \
  2>&1 | tee "$OUT/engine_models.log" | grep -v "^\s*$" | tail -n 20

# Sourced on the GPU machine, from the repo root: make `lorafleet` importable there. The image has
# torch/triton/transformers/peft but no network: install the project alone, or shim it.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lorafleet-out}
mkdir -p "$OUT"
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  shim=/tmp/lorafleet-shim/lorafleet
  rm -rf "$shim" && mkdir -p "$shim" && cp -r common/. "$shim"/
  for d in worker kernels router operator; do ln -s "$PWD/$d" "$shim/$d"; done
  export PYTHONPATH=/tmp/lorafleet-shim
fi
# Wheels that bench/gpu_wheels.sh put in .whl (carried here): the worker's HTTP stack, after the
# image's own packages on the path (they only add what the image lacks).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lorafleet-wheels \
    .whl/*.whl >>"$OUT/install.log" 2>&1 && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/lorafleet-wheels
  python3 -c "import fastapi, uvicorn, openai, aiohttp, lorafleet.worker.server.app" 2>>"$OUT/install.log" \
    || echo "WARNING: the carried wheels do not import (see $OUT/install.log): the HTTP test suites will not run"
fi
python3 -c "import lorafleet.worker.engine.engine, lorafleet.kernels.lora.launch" || return 1 2>/dev/null || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

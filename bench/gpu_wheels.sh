#!/usr/bin/env bash
# Run here, where pip reaches PyPI: the worker's HTTP stack (what the GPU image lacks: FastAPI,
# uvicorn, pydantic, the openai client, aiohttp (the served benchmark's client) and uvloop, and those
# of their needs the image does not hold; it has
# anyio, annotated-doc, click, h11, httpx, idna, prometheus-client, typing-extensions) as CPython
# 3.12 x86-64 wheels in .whl/ (git-ignored), at the versions installed here. gpu_env.sh warns when
# they do not import there. Carry .whl to the GPU machine; bench/gpu_env.sh
# installs them there, so the HTTP suites (tests/worker/test_api_gpu.py, test_admin_gpu.py) run:
#   bash bench/gpu_wheels.sh     # here, once
#   source bench/gpu_env.sh && pytest -m gpu tests/kernels tests/worker tests/bench   # there
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="fastapi starlette pydantic pydantic_core annotated-types typing-inspection opentelemetry-api uvicorn httptools
      openai jiter sniffio distro httpx2 httpcore2 truststore redis xgrammar apache-tvm-ffi
      aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl uvloop"
rm -rf .whl && mkdir .whl
for pkg in $PKGS; do
  version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg" 2>/dev/null || true)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$pkg${version:+==$version}"
done
ls .whl

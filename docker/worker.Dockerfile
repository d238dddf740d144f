# syntax=docker/dockerfile:1.7
# lorafleet worker: `lorafleet worker` on CUDA (engine + Triton LoRA kernels + HTTP server).
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/lorafleet/worker:0.1.0 .
# The operator runs it as `lorafleet worker --model ... --admin-port ...` (operator/builders.py).

ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/lorafleet
ENV PATH=/opt/lorafleet/bin:$PATH
# torch first, in its own layer: it is most of the image and changes least often.
# The version CI tests (.ci/run); PyPI's Linux wheels bundle their CUDA libraries.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY common ./common
COPY worker ./worker
COPY kernels ./kernels
COPY router ./router
COPY operator ./operator
RUN pip install ".[engine,serve,triton]"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles its launcher with gcc and Python.h at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp lorafleet
COPY --from=build /opt/lorafleet /opt/lorafleet
ENV PATH=/opt/lorafleet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    HF_HUB_OFFLINE=1
USER 10001:10001
# 8000: OpenAI-compatible API, /metrics, /health, /ready. 8001: admin API (keep behind the NetworkPolicy).
EXPOSE 8000 8001
ENTRYPOINT ["lorafleet"]
CMD ["worker", "--help"]

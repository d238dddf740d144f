# syntax=docker/dockerfile:1.7
# lorafleet control plane: `lorafleet operator` and `lorafleet router` (no torch, no GPU).
# Build from the repository root:
#   docker build -f docker/control-plane.Dockerfile -t ghcr.io/lorafleet/control-plane:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/lorafleet
ENV PATH=/opt/lorafleet/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY common ./common
COPY worker ./worker
COPY kernels ./kernels
COPY router ./router
COPY operator ./operator
# serve: router (FastAPI, httpx, Redis); operator: kopf. The engine extras (torch) stay out.
RUN pip install ".[serve,operator]"

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp lorafleet
COPY --from=build /opt/lorafleet /opt/lorafleet
ENV PATH=/opt/lorafleet/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["lorafleet"]
CMD ["--help"]

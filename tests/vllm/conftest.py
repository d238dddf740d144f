"""The real-vLLM tier: one vLLM server for the session, our worker on the same tiny model beside it.

vLLM is started once (module-scoped servers would start it per file: minutes each on 2 cores) with
`vonly` registered at start-up (`--lora-modules`), so the fleet tests have an adapter that only vLLM
holds; the oracle tests register the others over `/v1/load_lora_adapter`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.fake_worker import free_port
from tests.vllm.assets import ORACLE_ADAPTERS, make_vllm_assets
from tests.vllm.vllm_server import SERVED_NAME, VllmServer, skip_reason, vllm_python

VLLM_ONLY = "vonly"  # registered on vLLM at start-up (the `poem` weights), nowhere else


@pytest.fixture(scope="session")
def vllm_assets(tmp_path_factory) -> Path:
    return make_vllm_assets(tmp_path_factory.mktemp("vllm-assets"))


@pytest.fixture(scope="session")
def adapter_dirs(vllm_assets) -> dict[str, Path]:
    return {a.name: vllm_assets / "adapters" / a.name for a in ORACLE_ADAPTERS}


@pytest.fixture(scope="session")
def vllm_server(vllm_assets, adapter_dirs, tmp_path_factory) -> Iterator[VllmServer]:
    python = vllm_python()
    if python is None:
        pytest.skip(skip_reason())
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    server = VllmServer(python, vllm_assets / "model", free_port(), {VLLM_ONLY: adapter_dirs["poem"]}, log)
    server.start()
    print(f"\nvLLM answered after {server.started_in_s:.1f}s (log: {log})")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def served_name() -> str:
    return SERVED_NAME

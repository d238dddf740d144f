"""Fixtures shared by the worker tests: the demo model's config and its adapters as `lora_modules`;
a served worker on the demo model (`worker`, one per module; a module with other settings defines
its own) and the official client on it (`client`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.worker.config import ModelConfig


@pytest.fixture
def model(demo_model: Path) -> ModelConfig:
    return ModelConfig.from_folder(demo_model)


@pytest.fixture(scope="module")
def modules(demo_adapters: dict[str, Path]) -> dict[str, str]:
    return {n: str(p) for n, p in demo_adapters.items()}


@pytest.fixture(scope="module")
def worker(demo_model: Path, demo_adapters: dict[str, Path]):
    from tests.worker.worker_harness import serve

    yield from serve(demo_model, demo_adapters)


@pytest.fixture(scope="module")
def client(worker):
    import openai

    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)

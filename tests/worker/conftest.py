"""Fixtures shared by the worker tests: the demo model's config and its adapters as `lora_modules`."""

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

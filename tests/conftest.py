"""Shared fixtures: the demo assets (tiny model + PEFT adapters), built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lorafleet.worker.demo_assets import make_demo_assets

    cached = os.environ.get("LORAFLEET_DEMO_ASSETS")
    out = Path(cached) if cached else tmp_path_factory.mktemp("demo")
    return make_demo_assets(out)


@pytest.fixture(scope="session")
def demo_model(demo_assets: Path) -> Path:
    return demo_assets / "model"


@pytest.fixture(scope="session")
def demo_adapters(demo_assets: Path) -> dict[str, Path]:
    root = demo_assets / "adapters"
    return {p.name: p for p in sorted(root.iterdir()) if p.is_dir()}

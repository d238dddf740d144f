"""Shared fixtures: the demo assets (tiny model + PEFT adapters), built once per test session."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tests_link_dir() -> Path:
    """A folder holding only a link to this `tests/`, so `tests.*` imports by package path without
    the repo root on sys.path: the root's fixed folders `kernels/` and `operator/` would shadow PyPI's
    `kernels` (transformers >= 5.2 imports it when installed: a demo model build then failed) and the
    stdlib's `operator`. Subprocesses that import `tests.*` get it on their PYTHONPATH."""
    link_dir = Path(tempfile.gettempdir()) / f"lorafleet-tests-{os.getuid()}-{hashlib.sha1(bytes(ROOT)).hexdigest()[:10]}"
    link = link_dir / "tests"
    if not link.is_symlink() or link.resolve() != ROOT / "tests":
        link_dir.mkdir(exist_ok=True)
        fresh = link_dir / f".tests-{os.getpid()}"
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(ROOT / "tests")
        os.replace(fresh, link)  # atomic: concurrent sessions never see a half-made link
    return link_dir


TESTS_PATH = str(tests_link_dir())
if TESTS_PATH not in sys.path:
    sys.path.insert(0, TESTS_PATH)

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU suite: the interpreter's redundant patching skipped
    from tests.triton_interpreter import install

    install()


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

"""Start-up objects leave the cycle collector once the engine is built (worker/server/gc_freeze.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import weakref

import pytest

from lorafleet.worker.server import runtime as runtime_mod
from lorafleet.worker.server.gc_freeze import freeze_startup_objects
from tests.worker.worker_harness import worker_settings


def test_freeze_collects_then_freezes():
    class Node:
        pass

    gc.unfreeze()
    node = Node()
    node.me = node  # start-up garbage in a cycle: collected first, not frozen
    gone = weakref.ref(node)
    del node
    try:
        frozen = freeze_startup_objects()
        # At most what it returned: another thread (tqdm's monitor, left by earlier tests) may free
        # a few frozen objects between the two counts (a fresh-clone CI run saw 596,076 -> 596,072).
        assert 1000 < gc.get_freeze_count() <= frozen
        assert gone() is None
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("freeze", [True, False])
def test_runtime_freezes_after_the_engine_is_built(freeze, demo_model, demo_adapters, monkeypatch):
    calls = []
    monkeypatch.setattr(runtime_mod, "freeze_startup_objects", lambda: calls.append("frozen") or 1)
    settings = dataclasses.replace(worker_settings(demo_model, {}), freeze_gc=freeze)
    runtime = runtime_mod.WorkerRuntime.create(settings)

    async def run() -> None:
        await runtime._load()
        assert runtime.engine is not None and runtime.error is None
        await runtime.stop()

    asyncio.run(run())
    assert calls == (["frozen"] if freeze else [])

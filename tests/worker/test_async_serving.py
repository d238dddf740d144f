"""Async scheduling in the server's engine thread (worker/engine/async_engine.py): its streams equal
offline generate, and a launch that fails fails its requests while the server recovers."""

from __future__ import annotations

import asyncio

import pytest

from tests.worker.async_harness import MIXED, _engine, greedy


def test_server_loop_with_async_scheduling(demo_model, modules):
    """The engine thread (worker/engine/async_engine.py) unchanged: streams equal offline generate."""
    from lorafleet.worker.engine.async_engine import AsyncEngine

    served, offline = _engine(demo_model, modules, True), _engine(demo_model, modules, False)
    cases = [(p, a) for p, a in MIXED[:5]]
    free = served.blocks.num_free

    async def one(engine, prompt, adapters, n):
        stream = await engine.submit(prompt, greedy(n), adapters)
        return "".join([out.text_delta async for out in stream])

    async def main():
        engine = AsyncEngine(served)
        engine.start()
        try:
            texts = await asyncio.gather(*(one(engine, p, a, 4 + i) for i, (p, a) in enumerate(cases)))
            assert not await engine.call(served.has_unfinished)
            return texts, await engine.call(lambda: served.blocks.num_free)
        finally:
            await engine.stop()

    texts, free_after = asyncio.run(main())
    want = offline.generate([p for p, _ in cases], [greedy(4 + i) for i in range(len(cases))], [a for _, a in cases])
    assert texts == [c.text for c in want]
    assert free_after == free and served.async_steps.stats.overlapped > 0


def test_failing_launch_fails_its_requests_and_the_server_recovers(demo_model, modules):
    from lorafleet.worker.engine.async_engine import AsyncEngine, EngineFailure

    served, offline = _engine(demo_model, modules, True), _engine(demo_model, modules, False)
    real = served.runner.launch
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a launch from the device, with a step in flight
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    async def run(engine, prompt):
        stream = await engine.submit(prompt, greedy(8), ())
        return "".join([out.text_delta async for out in stream])

    async def main():
        engine = AsyncEngine(served)
        engine.start()
        try:
            with pytest.raises(EngineFailure, match="boom"):
                await run(engine, "Hello world")
            assert engine.alive and await engine.call(served.blocks.usage) == 0.0
            assert not await engine.call(served.has_unfinished)
            return await run(engine, "Hello world")
        finally:
            await engine.stop()

    served.runner.launch = broken
    try:
        text = asyncio.run(main())
    finally:
        del served.runner.launch
    assert text == offline.generate(["Hello world"], greedy(8))[0].text

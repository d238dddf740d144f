"""The engine thread: outputs equal offline generate, cancel frees blocks, eager errors, disk reads
off the engine thread, and a failing step fails only its requests."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.async_engine import AsyncEngine, EngineFailure
from lorafleet.worker.engine.engine import LLMEngine, RequestError
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.lora.registry import AdapterNotFound

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
CONFIG = EngineConfig(max_loras=2, max_cpu_loras=2, max_loras_per_request=2, num_kv_blocks=128)


@pytest.fixture(scope="module")
def engines(demo_model, demo_adapters):
    mods = {n: str(demo_adapters[n]) for n in ("sql", "chat", "poem")}
    return LLMEngine(demo_model, CONFIG, lora_modules=mods), LLMEngine(demo_model, CONFIG, lora_modules=mods)


async def _run(engine: AsyncEngine, prompt, sp, adapters=()) -> tuple[str, str]:
    stream = await engine.submit(prompt, sp, adapters)
    text, reason = [], None
    async for out in stream:
        text.append(out.text_delta)
        reason = out.finish_reason
    return "".join(text), reason


def test_outputs_equal_offline_and_disk_reads_run_off_the_engine_thread(engines):
    served, offline = engines
    # max_cpu_loras=2 with three adapters: one of them is on disk and must be read again.
    assert sorted(served.registry.tier(n) for n in ("sql", "chat", "poem")).count("disk") == 1
    reader_threads: list[str] = []
    real_read = served.registry.read

    def spy(path):
        reader_threads.append(threading.current_thread().name)
        return real_read(path)

    served.registry.read = spy
    cases = [("Hello world", ()), ("SELECT name", (("sql", 1.0),)), ("Roses are red", (("poem", 1.0),)),
             ("Hi there", (("chat", 1.0),)), ("Mixed", (("sql", 0.5), ("chat", 0.5)))]

    async def main():
        engine = AsyncEngine(served)
        engine.start()
        try:
            return await asyncio.gather(*(_run(engine, p, GREEDY, a) for p, a in cases))
        finally:
            await engine.stop()

    try:
        results = asyncio.run(main())
    finally:
        del served.registry.read
    want = offline.generate([p for p, _ in cases], GREEDY, [a for _, a in cases])
    assert [t for t, _ in results] == [c.text for c in want]
    assert reader_threads and all(name != "engine" for name in reader_threads)


def test_cancel_frees_blocks_and_adapters(engines):
    served, _ = engines
    sp = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        engine = AsyncEngine(served)
        engine.start()
        try:
            stream = await engine.submit("Once upon a time", sp, (("sql", 1.0),))
            for _ in range(3):
                await stream.__anext__()
            assert await engine.call(served.blocks.usage) > 0
            stream.cancel()
            stream.cancel()  # idempotent
            for _ in range(100):
                if not await engine.call(served.has_unfinished):
                    break
                await asyncio.sleep(0.01)
            return (await engine.call(served.blocks.usage), served.registry.entries["sql"].in_flight,
                    await engine.call(served.has_unfinished))
        finally:
            await engine.stop()

    assert asyncio.run(main()) == (0.0, 0, False)


def test_errors_are_raised_before_streaming(engines):
    served, _ = engines

    async def main():
        engine = AsyncEngine(served)
        engine.start()
        try:
            with pytest.raises(AdapterNotFound):
                await engine.submit("x", GREEDY, (("nope", 1.0),))
            with pytest.raises(RequestError):
                await engine.submit([], GREEDY)
            assert not await engine.call(served.has_unfinished)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_failing_step_fails_its_requests_and_the_thread_survives(engines):
    served, offline = engines
    real_run = served.runner.run
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_run(*args, **kwargs)

    async def main():
        engine = AsyncEngine(served)
        engine.start()
        try:
            with pytest.raises(EngineFailure, match="boom"):
                await _run(engine, "Hello world", GREEDY)
            assert engine.alive and await engine.call(served.blocks.usage) == 0.0
            return await _run(engine, "Hello world", GREEDY)
        finally:
            await engine.stop()

    served.runner.run = broken
    try:
        text, _ = asyncio.run(main())
    finally:
        del served.runner.run
    assert text == offline.generate(["Hello world"], GREEDY)[0].text

"""The served engine keeps its batch full under a closed loop, and says so in its metrics.

64 streaming clients on the engine thread (worker/engine/async_engine.py) with SSE framing
(`serving.stream_events`), each sending its next request as the last ends, with staggered output
lengths (64 on average: one request ends per step, twice the rate of issue 55's GPU run with 128);
the model's forward made slow (a sleep that releases the GIL, as a GPU step would) so the host's
per-token work is small beside a step, as on a GPU. In steady state the steps must run at least
0.9 x 64 requests on average (`lorafleet:step_running_requests`): a batch that drains before it
refills, admissions that wait on the HTTP loop, or clients slow to restart would show here. (A
request that ends leaves its slot empty at least for the step during which its client sends the
next one; with 16 tokens on average, four ends a step, two runs here measured 56.6 and over 57.6.) The
per-step metrics are checked against the engine's own counts.
"""

from __future__ import annotations

import asyncio
import random
import time

from prometheus_client import generate_latest

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.async_engine import AsyncEngine
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.server.metrics import WorkerMetrics
from lorafleet.worker.server.serving import stream_events

CLIENTS = 64
STEP_S = 0.02  # the forward's floor: a GPU step's time, during which the host only waits


class Steps:
    """Each step's running count as the observer saw it, with the metrics module observing too."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.running: list[tuple[float, int]] = []
        self.paths: list[str] = []

    def on_first_token(self, seconds: float) -> None:
        self.metrics.on_first_token(seconds)

    def on_token_gap(self, seconds: float) -> None:
        self.metrics.on_token_gap(seconds)

    def on_finished(self, reason: str, prompt_tokens: int, generated: int, seconds: float) -> None:
        self.metrics.on_finished(reason, prompt_tokens, generated, seconds)

    def on_step(self, running: int, waiting: int, tokens: int, seconds: float, path: str) -> None:
        self.running.append((time.monotonic(), running))
        self.paths.append(path)
        self.metrics.on_step(running, waiting, tokens, seconds, path)


def test_closed_loop_keeps_the_batch_full(demo_model):
    engine = LLMEngine(demo_model, EngineConfig(max_num_seqs=CLIENTS, num_kv_blocks=2048, warmup=False))
    forward = engine.model.forward

    def slow(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        time.sleep(max(0.0, STEP_S - (time.perf_counter() - t0)))
        return out

    engine.model.forward = slow
    metrics = WorkerMetrics("demo", engine.config.max_loras)
    steps = Steps(metrics)
    rng = random.Random(0)
    duration, warmup = 8.0, 3.0

    async def client(aengine: AsyncEngine, end: float) -> int:
        done = 0
        first = True
        while time.monotonic() < end:
            n = rng.randint(1, 128) if first else rng.randint(32, 96)  # staggered, as bench/loadgen.py's
            first = False
            prompt = [rng.randrange(10, 400) for _ in range(16)]
            stream = await aengine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            events = [e async for e in stream_events([stream], lambda i, out: [{"text": out.text_delta}], None, 16)]
            assert events[-1] == "data: [DONE]\n\n" and len(events) == n + 1
            done += 1
        return done

    async def main() -> list[int]:
        aengine = AsyncEngine(engine, observer=steps)
        aengine.start()
        try:
            end = time.monotonic() + duration
            return await asyncio.gather(*(client(aengine, end) for _ in range(CLIENTS)))
        finally:
            await aengine.stop()

    t0 = time.monotonic()
    finished = asyncio.run(main())
    assert sum(finished) > CLIENTS
    window = [r for t, r in steps.running if t0 + warmup <= t <= t0 + duration - 0.5]
    assert len(window) >= 20, f"only {len(window)} steps in the window"
    mean = sum(window) / len(window)
    assert mean >= 0.9 * CLIENTS, f"mean running batch {mean:.1f} of {CLIENTS} clients"
    # The metrics saw every step the observer saw, with their paths (CPU without graphs: eager).
    text = generate_latest(metrics.registry).decode()
    count = f'lorafleet:step_running_requests_count{{model_name="demo"}} {float(len(steps.running))}'
    assert count in text
    assert set(steps.paths) == {"eager"} and 'path="eager"' in text
    assert f'vllm:iteration_tokens_total_count{{model_name="demo"}} {float(len(steps.running))}' in text

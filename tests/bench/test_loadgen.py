"""The served benchmarks' load generator against a fake worker streaming at a known rate and TTFT
(bench/fake_stream.py in its own process): what it measures must be what was sent."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
INTERVAL_MS, TTFT_MS = 20.0, 40.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_fake(*flags: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "fake_stream.py"), "--port", str(port), "--interval-ms",
                             str(INTERVAL_MS), "--ttft-ms", str(TTFT_MS), *flags], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    return proc, url


@pytest.fixture(scope="module")
def fake():
    proc, url = _start_fake()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fake_steps():
    proc, url = _start_fake("--step-sync")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


async def _token_times(url: str, start_offsets_s: list[float], tokens: int) -> list[list[float]]:
    """Each stream's SSE token arrival times (monotonic), streams started at the given offsets."""
    import asyncio

    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "a", "prompt": "x", "max_tokens": tokens, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    t0 = time.monotonic()

    async def one(offset: float) -> list[float]:
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        times: list[float] = []
        while True:
            line = await reader.readline()
            if line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
        writer.close()
        return times

    return list(await asyncio.gather(*(one(o) for o in start_offsets_s)))


@pytest.mark.parametrize("step_sync", [False, True])
def test_streams_are_staggered_or_step_synchronized(fake, fake_steps, step_sync):
    """Two streams started half an interval apart: on their own schedules their tokens stay half an
    interval apart; with --step-sync both get each token at the same step tick."""
    import asyncio

    half = INTERVAL_MS / 2e3
    a, b = asyncio.run(_token_times(fake_steps if step_sync else fake, [0.0, half], 12))
    assert len(a) == len(b) == 12
    # Pair each of b's later tokens with a's nearest one (b joins a tick after a did, or half an interval after).
    gaps = [min(abs(tb - ta) for ta in a) * 1e3 for tb in b[2:10]]
    gap = sorted(gaps)[len(gaps) // 2]
    if step_sync:
        assert gap <= 2.5
    else:
        assert INTERVAL_MS / 2 - 4.0 <= gap <= INTERVAL_MS / 2 + 4.0


def test_step_synchronized_rate_and_ttft(fake_steps, bench_importable):
    """Every running stream gets a token per tick: the rate is the streams' count per interval, and
    a first token comes at the first tick at least TTFT_MS after the request (at most one interval more)."""
    from bench.loadgen import Workload, run_load

    streams = 16
    w = Workload("closed", concurrency=streams, duration_s=4.0, warmup_s=1.0, new_tokens=50, fixed_length=True)
    got = run_load(fake_steps, w)
    assert got["errors"] == 0
    assert got["tokens_per_s"] == pytest.approx(streams * 1e3 / INTERVAL_MS, rel=0.1)
    assert TTFT_MS <= got["ttft_p50_ms"] <= TTFT_MS + 2 * INTERVAL_MS
    assert got["itl_p50_ms"] == pytest.approx(INTERVAL_MS, abs=3.0)
    assert got["mean_new_tokens"] == 50


def test_closed_loop_measures_the_rate_and_ttft_sent(fake, bench_importable):
    from bench.loadgen import Workload, run_load

    streams = 16
    w = Workload("closed", concurrency=streams, duration_s=4.0, warmup_s=1.0, new_tokens=50, fixed_length=True)
    got = run_load(fake, w)
    expected = streams * 1e3 / INTERVAL_MS  # 800 tokens/s
    assert got["errors"] == 0
    assert got["tokens_per_s"] == pytest.approx(expected, rel=0.1)
    # A first token comes TTFT_MS after the request: the generator must not report less, and may add
    # scheduling delay on a busy machine, but not a client's tens of ms (httpx's async client added ~50).
    assert TTFT_MS <= got["ttft_p50_ms"] <= TTFT_MS + 2 * INTERVAL_MS
    assert got["itl_p50_ms"] == pytest.approx(INTERVAL_MS, abs=3.0)
    assert got["mean_new_tokens"] == 50  # read from each stream's usage chunk
    assert 0 < got["client_cpu_share"] < 0.7


def test_poisson_arrivals_and_two_client_processes(fake, bench_importable):
    from bench.loadgen import Workload, run_load

    w = Workload("poisson", rate=20.0, duration_s=4.0, warmup_s=1.0, new_tokens=20, fixed_length=True)
    got = run_load(fake, w, processes=2)
    assert got["errors"] == 0 and got["client_processes"] == 2
    # 20 req/s of 20 tokens: ~400 tokens/s once the window is past the first streams' ramp-up
    # (a Poisson count over 3 s: 60 ± 8 requests, so a wide band).
    assert 250 <= got["tokens_per_s"] <= 560
    assert TTFT_MS <= got["ttft_p50_ms"] <= TTFT_MS + 2 * INTERVAL_MS


def test_a_stream_that_ends_in_an_error_is_counted(bench_importable):
    """An error event then [DONE] (how the worker and router end a failed stream) is an error."""
    import asyncio

    import aiohttp

    from bench.loadgen import stream_one

    async def serve_and_read() -> object:
        async def handler(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"boom","code":502}}\n\ndata: [DONE]\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, aiohttp.ClientSession() as session:
            return await stream_one(session, f"http://127.0.0.1:{port}/v1/completions", json.dumps({}).encode(), time.monotonic())

    rec = asyncio.run(serve_and_read())
    assert "boom" in rec.error and rec.events == 1

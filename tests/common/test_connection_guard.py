"""Slow clients cannot hold the router's or the worker's connections: real `lorafleet router` and
`lorafleet worker` processes, slow clients on 127.0.0.2 (idle, a head a byte at a time, a body a
byte at a time), fast clients on 127.0.0.1 meanwhile."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.fake_worker import FakeWorkerConfig, FakeWorkerProcess, free_port, wait_http

TIMEOUT_S = 1.0
PER_CLIENT = 40
FLAGS = ["--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--keep-alive-timeout", "1",
         "--max-client-connections", str(PER_CLIENT), "--max-server-connections", "500"]
SLOW_HOST = "127.0.0.2"  # another client address on loopback: the per-client cap is per IP
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


async def slow_client(port: int, kind: str) -> tuple[float, bytes]:
    """Connects from SLOW_HOST and misbehaves until the server closes: (seconds held, what it said)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(SLOW_HOST, 0))
    started = time.monotonic()
    if kind == "head":
        payload = HEAD + b"x-pad: " + b"a" * 200
    elif kind == "body":
        writer.write(HEAD + b"content-length: 1000\r\n\r\n")
        payload = b"{" * 1000
    else:
        payload = b""
    answer = b""

    async def trickle() -> None:
        for byte in payload:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)

    sender = asyncio.create_task(trickle())
    try:
        while chunk := await asyncio.wait_for(reader.read(4096), timeout=15):
            answer += chunk
    except (asyncio.TimeoutError, ConnectionError):
        answer += b"<held open>" if not answer else b""
    finally:
        sender.cancel()
        writer.close()
    return time.monotonic() - started, answer


async def fast_requests(url: str, path: str, seconds: float, body: dict | None) -> list[tuple[int, float]]:
    out = []
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            r = await (client.post(url + path, json=body) if body else client.get(url + path))
            out.append((r.status_code, time.monotonic() - t0))
            await asyncio.sleep(0.05)
    return out


async def siege(port: int, url: str, path: str, body: dict | None) -> dict:
    kinds = ["idle"] * 10 + ["head"] * 10 + ["body"] * 10
    slow = [asyncio.create_task(slow_client(port, k)) for k in kinds]
    await asyncio.sleep(0.3)
    over = [asyncio.create_task(slow_client(port, "idle")) for _ in range(PER_CLIENT)]  # 10 fit, 30 over the cap
    fast = await fast_requests(url, path, 2.5, body)
    return {"slow": list(zip(kinds, await asyncio.gather(*slow))), "over": await asyncio.gather(*over), "fast": fast}


def check(result: dict) -> None:
    for kind, (held, answer) in result["slow"]:
        assert b"<held open>" not in answer, f"a {kind} connection was held open"
        assert held < TIMEOUT_S + 3, (kind, held)
        if kind in ("idle", "head"):
            assert answer.startswith(b"HTTP/1.1 408"), (kind, answer[:80])
    refused = [a for _, a in result["over"] if a.startswith(b"HTTP/1.1 429")]
    assert len(refused) == PER_CLIENT - 10, [a[:40] for _, a in result["over"]]
    assert all(held < TIMEOUT_S + 3 for held, _ in result["over"])
    assert result["fast"] and all(status == 200 for status, _ in result["fast"]), result["fast"]
    # Fast clients were never starved: bounded latency on a shared machine (not a performance claim).
    assert max(latency for _, latency in result["fast"]) < 5


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[int, str]]:
    worker = FakeWorkerProcess(FakeWorkerConfig(name="w0", lora_modules={"a": "/adapters/a"})).start()
    token = tmp_path / "admin-token"
    token.write_text(worker.cfg.admin_token)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorafleet", "router", "--port", str(port), "--worker", worker.url,
         "--admin-token-file", str(token), "--lora-modules", "a=/adapters/a", "--log-level", "warning", *FLAGS])
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout_s=30)
        yield port, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        worker.kill()


@pytest.mark.timeout(120)
def test_router_slow_clients_are_closed_and_fast_ones_served(router) -> None:
    port, url = router
    check(asyncio.run(siege(port, url, "/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2})))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_slow_clients_are_closed_and_fast_ones_served(demo_model: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet", "worker", "--model", str(demo_model), "--host",
                             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--log-level", "warning",
                             *FLAGS],
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", timeout_s=240)
        check(asyncio.run(siege(port, url, "/v1/completions", {"model": str(demo_model), "prompt": "hi",
                                                                "max_tokens": 2})))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_server_cap_stays_below_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from lorafleet.connection_guard import ConnectionLimits, within_file_limit

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 4096))
    assert within_file_limit(ConnectionLimits(max_connections=4096)).max_connections == 1024 - 256
    assert within_file_limit(ConnectionLimits(max_connections=0)).max_connections == 1024 - 256
    assert within_file_limit(ConnectionLimits(max_connections=100)).max_connections == 100

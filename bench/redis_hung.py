"""Router latency with its Redis healthy, hung (SIGSTOP) and dead, with and without the breaker.

Setup, all on loopback: a fast fake upstream (bench/router_overhead.py's), a private redis-server,
and the router (`--redis-url`, a tenants file whose tenant has limits, so every request takes a
lease in Redis and gives it back). An open-loop load at a fixed rate runs through each phase:

1. healthy: Redis answers.
2. hung: Redis SIGSTOPped (it accepts connections and never answers), measured from the stop on
   (the breaker's first few timeouts included).
3. recovered: SIGCONT; measured after the breaker has closed again.
4. dead: Redis killed (connections refused at once).

Run twice: with the breaker (the default) and "without" it (`--redis-breaker-failures` too high
to open), where every request waits for the Redis timeout while Redis hangs.

Usage: python bench/redis_hung.py [--rate 100] [--seconds 5] [--repeat 3] [--out bench/results/redis_hung.json]
(the table: per case and phase, the median over the repeats of each run's p50 and p99)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.router_overhead import UPSTREAM, Conn, free_port, wait
from lorafleet.router.tenants import hash_api_key

ROOT = Path(__file__).resolve().parent.parent
KEY = "bench-key"


def request_bytes(port: int) -> bytes:
    body = json.dumps({"model": "a", "prompt": "hi", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def open_loop(port: int, rate: float, seconds: float, connections: int = 32) -> list[float]:
    """Latency from each request's scheduled time (no coordinated omission)."""
    req = request_bytes(port)
    pool: asyncio.Queue[Conn] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(await Conn.open(port))
    latencies: list[float] = []

    async def one(scheduled: float) -> None:
        conn = await pool.get()
        await conn.post(req)
        pool.put_nowait(conn)
        latencies.append(time.perf_counter() - scheduled)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    for _ in range(connections):
        (await pool.get()).writer.close()
    return latencies


def summary(lat: list[float]) -> dict[str, float]:
    ms = np.array(lat) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2), "requests": len(lat)}


def breaker_open(router_port: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{router_port}/metrics").text.splitlines():
        if line.startswith("lorafleet_router_placement_store_breaker_open "):
            return float(line.split()[1])
    return float("nan")


def start_redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("redis-server did not start")


def run_case(breaker: bool, up_port: int, rate: float, seconds: float, tmp: Path) -> dict[str, object]:
    redis_port, router_port = free_port(), free_port()
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "bench", "api_key_sha256": hash_api_key(KEY),
                                                "max_concurrency": 10_000, "requests_per_minute": 10_000_000}]}))
    redis = start_redis(redis_port)
    router = subprocess.Popen(
        [sys.executable, "-m", "lorafleet", "router", "--port", str(router_port), "--log-level", "warning",
         "--worker", f"http://127.0.0.1:{up_port}", "--lora-modules", "a=/a", "--tenants-file", str(tenants),
         "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
         *([] if breaker else ["--redis-breaker-failures", str(10**9)])],
        stderr=subprocess.DEVNULL)
    phases: dict[str, object] = {}
    try:
        wait(f"http://127.0.0.1:{router_port}/ready")
        asyncio.run(open_loop(router_port, rate, 1.0))  # warm up
        phases["healthy"] = summary(asyncio.run(open_loop(router_port, rate, seconds)))
        os.kill(redis.pid, signal.SIGSTOP)
        phases["hung"] = summary(asyncio.run(open_loop(router_port, rate, seconds)))
        phases["hung"]["breaker_open_at_end"] = breaker_open(router_port)
        os.kill(redis.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while breaker and breaker_open(router_port) != 0 and time.monotonic() < deadline:
            asyncio.run(open_loop(router_port, rate, 0.2))
        phases["recovered"] = summary(asyncio.run(open_loop(router_port, rate, seconds)))
        redis.kill()
        redis.wait()
        phases["dead"] = summary(asyncio.run(open_loop(router_port, rate, seconds)))
    finally:
        if redis.poll() is None:
            os.kill(redis.pid, signal.SIGCONT)
            redis.kill()
        router.terminate()
        router.wait(timeout=10)
    return phases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per phase (default 5)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each case, alternated (default 3)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/redis_hung.json")
    args = p.parse_args(argv)
    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])
    try:
        wait(f"http://127.0.0.1:{up_port}/health")
        runs: list[dict[str, dict]] = []
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeat):  # alternated, so that the machine's load falls on both alike
                runs.append({"breaker": run_case(True, up_port, args.rate, args.seconds, Path(tmp)),
                             "no_breaker": run_case(False, up_port, args.rate, args.seconds, Path(tmp))})
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    # Per case and phase: the median over the repeats of each run's p50 and p99.
    cases = {case: {phase: {k: round(float(np.median([r[case][phase][k] for r in runs])), 2)
                            for k in ("p50_ms", "p99_ms")}
                    for phase in runs[0][case]} for case in runs[0]}
    print(f"{'case':<11} {'phase':<10} {'p50 ms':>8} {'p99 ms':>8}   (median of {args.repeat} runs)")
    for case, phases in cases.items():
        for phase, s in phases.items():
            print(f"{case:<11} {phase:<10} {s['p50_ms']:>8} {s['p99_ms']:>8}")
    result = {"rate_rps": args.rate, "seconds_per_phase": args.seconds, "repeats": args.repeat, "cases": cases,
              "runs": runs,
              "router_defaults": {"redis_timeout_s": 0.1, "redis_breaker_failures": 3, "redis_breaker_cooldown_s": 1.0},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
              "note": "load generator, upstream, Redis and router share this machine's cores"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

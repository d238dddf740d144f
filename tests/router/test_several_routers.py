"""Several `lorafleet router` processes as one (issue 54, item 6), on a real Redis and fake workers.

Three router processes share one redis-server (started here, on a free port, so the test can stop
it): a cold adapter requested through all three at once is loaded once per chosen replica, all three
route it to the same replica, a tenant's request rate is counted once across them, and with Redis
stopped each of them still routes (fail-open).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lorafleet.protocol import HEADER_REPLICA
from tests.router.conftest import ADMIN_TOKEN, CATALOG, start_workers
from tests.router.fake_worker import free_port

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = 3
BULK_KEY, METERED_KEY = "bulk-key", "metered-key"
RPM = 6


def _tenants(tmp_path: Path) -> Path:
    def sha(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "bulk", "api_key_sha256": [sha(BULK_KEY)]},
        {"name": "metered", "api_key_sha256": [sha(METERED_KEY)], "requests_per_minute": RPM},
    ]}))
    return path


def _start_router(port: int, workers, redis_url: str, tmp_path: Path) -> subprocess.Popen:
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    args = [sys.executable, "-m", "lorafleet", "router", "--port", str(port), "--host", "127.0.0.1",
            "--redis-url", redis_url, "--tenants-file", str(_tenants(tmp_path)),
            "--admin-token-file", str(token), "--poll-interval", "0.2", "--load-timeout", "20",
            "--log-level", "warning", "--lora-modules", *[f"{k}={v}" for k, v in CATALOG.items()]]
    for w in workers:
        args += ["--worker", w.worker_arg]
    return subprocess.Popen(args, cwd=ROOT)


def _wait_ready(urls: list[str], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 90
    pending = set(urls)
    while pending and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a router process exited"
        for url in list(pending):
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    assert not pending, f"routers not ready: {pending}"


def _cold_loads(url: str) -> float:
    """The router's `lorafleet_router_cold_loads_total`, all replicas together."""
    lines = httpx.get(url + "/metrics", timeout=5).text.splitlines()
    return sum(float(line.rpartition(" ")[2]) for line in lines
               if line.split("{")[0].split(" ")[0] == "lorafleet_router_cold_loads_total")


def _complete(url: str, key: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=60)


@pytest.fixture
def fleet(redis_server, tmp_path):
    """Two fake workers (w0 holds a, w1 holds b; c and d cold) behind three router processes."""
    redis_url, redis_proc = redis_server
    workers = start_workers([
        {"name": "w0", "lora_modules": {"a": CATALOG["a"]}, "load_delay_s": 1.0},
        {"name": "w1", "lora_modules": {"b": CATALOG["b"]}, "load_delay_s": 1.0},
    ])
    ports = [free_port() for _ in range(ROUTERS)]
    procs: list[subprocess.Popen] = []
    try:
        procs = [_start_router(port, workers, redis_url, tmp_path) for port in ports]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        _wait_ready(urls, procs)
        yield urls, workers, redis_proc
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for w in workers:
            w.kill()


def test_routers_share_loads_placement_and_limits_and_fail_open(fleet):
    urls, workers, redis_proc = fleet
    by_port = {w.url.removeprefix("http://"): w.cfg.name for w in workers}

    # 1. One cold adapter through all three routers at once: one load per chosen replica.
    n = 8 * ROUTERS
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: (i % ROUTERS, _complete(urls[i % ROUTERS], BULK_KEY, "c")), range(n)))
    assert all(r.status_code == 200 for _, r in answers), [(r.status_code, r.text) for _, r in answers]
    stats = {w.cfg.name: w.stats() for w in workers}
    calls = {name: s["load_calls"].get("c", 0) for name, s in stats.items()}
    assert all(c <= 1 for c in calls.values()), f"a replica was asked to load 'c' more than once: {calls}"
    # The routers count only the loads they asked for: one in all.
    assert sum(_cold_loads(url) for url in urls) == sum(calls.values())
    served_on = {by_port[r.headers[HEADER_REPLICA]] for _, r in answers}
    # Agreement: every replica a router sent 'c' to is one whose load the fleet started (once).
    assert served_on == {name for name, c in calls.items() if c == 1}, (served_on, calls)
    per_router = {k: {by_port[r.headers[HEADER_REPLICA]] for i, r in answers if i == k} for k in range(ROUTERS)}
    assert all(v == served_on for v in per_router.values()), per_router

    # 2. A tenant's requests-per-minute limit is global: RPM admitted in all, spread over the
    # routers; the next one is refused by whichever router it reaches.
    if time.time() % 60 > 45:  # fixed one-minute windows: do not straddle a boundary
        time.sleep(61 - time.time() % 60)
    codes = [_complete(urls[i % ROUTERS], METERED_KEY, "a").status_code for i in range(RPM)]
    assert codes == [200] * RPM
    over = [_complete(url, METERED_KEY, "a") for url in urls]
    assert [r.status_code for r in over] == [429] * ROUTERS, [(r.status_code, r.text) for r in over]

    # 3. Redis stopped: every router still routes, resident adapters and a cold one alike.
    redis_proc.kill()
    redis_proc.wait(timeout=10)
    for url in urls:
        for model in ("a", "b", "c"):
            r = _complete(url, BULK_KEY, model)
            assert r.status_code == 200, (url, model, r.status_code, r.text)
    with ThreadPoolExecutor(ROUTERS) as pool:
        cold = list(pool.map(lambda url: _complete(url, BULK_KEY, "d"), urls))
    assert [r.status_code for r in cold] == [200] * ROUTERS, [(r.status_code, r.text) for r in cold]

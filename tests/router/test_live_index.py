"""The gateway's live routing on the incremental index equals the plain policy (issue 54).

A real `lorafleet router` process with `--verify-index` in front of three fake workers: every
decision is made by `IndexedPolicy` on the fleet's `FleetIndex` (kept up to date from polls, loads,
unloads and the router's own in-flight counts) and also by an independent plain `Policy.schedule`
on `EndpointView`s of every replica; the router counts the two agreeing and disagreeing
(`lorafleet_router_index_checks_total`). Requests: Zipf-like over eight adapters (more than a
worker's CPU cache holds, so cold loads, admission and evictions happen), base-model requests,
streamed and not, eight at a time so in-flight counts move between decisions.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from lorafleet.protocol import HEADER_REPLICA, HEADER_ROUTE_REASON
from tests.router.conftest import ADMIN_TOKEN, start_workers
from tests.router.fake_worker import free_port

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = [f"x{i}" for i in range(8)]
REQUESTS = 160


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and m.group(1) == want:
            return float(m.group(2))
    return 0.0


def test_indexed_decisions_equal_the_plain_policy_on_a_live_router(tmp_path: Path) -> None:
    workers = start_workers([
        {"name": f"w{i}", "lora_modules": {a: f"/adapters/{a}" for a in ADAPTERS[i:i + 1]},
         "max_loras": 2, "max_cpu_loras": 3, "load_delay_s": 0.05, "token_delay_s": 0.01}
        for i in range(3)
    ])
    port = free_port()
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    args = [sys.executable, "-m", "lorafleet", "router", "--port", str(port), "--host", "127.0.0.1",
            "--verify-index", "--admin-token-file", str(token), "--poll-interval", "0.2",
            "--load-timeout", "20", "--log-level", "warning",
            "--lora-modules", *[f"{a}=/adapters/{a}" for a in ADAPTERS]]
    for w in workers:
        args += ["--worker", w.worker_arg]
    router = subprocess.Popen(args, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert router.poll() is None, "the router exited"
            try:
                if httpx.get(f"{url}/ready", timeout=1).json().get("replicas") == 3:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        rng = random.Random(7)
        weights = [1 / (k + 1) ** 1.1 for k in range(len(ADAPTERS))]

        def one(i: int) -> tuple[int, str, str]:
            model = "demo-base" if i % 9 == 0 else rng.choices(ADAPTERS, weights)[0]
            body = {"model": model, "prompt": "hi", "max_tokens": 1 + i % 7, "stream": i % 2 == 0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            return r.status_code, r.headers.get(HEADER_REPLICA, ""), r.headers.get(HEADER_ROUTE_REASON, "")

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(REQUESTS)))
        assert [s for s, _, _ in results if s != 200] == []
        assert len({r for _, r, _ in results}) == 3  # spread over the fleet
        assert {"cold", "hot", "base"} <= {why for _, _, why in results}  # loads and hits both decided
        text = httpx.get(f"{url}/metrics", timeout=10).text
        agree = _metric(text, "lorafleet_router_index_checks_total", result="agree")
        disagree = _metric(text, "lorafleet_router_index_checks_total", result="disagree")
        assert disagree == 0
        assert agree >= REQUESTS * 0.9  # a retry after a failure decides on the plain path, unchecked
    finally:
        router.terminate()
        router.wait(timeout=10)
        for w in workers:
            w.kill()

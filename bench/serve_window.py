"""The worker's own view of a bench/serve.py row: its step metrics scraped at the window's edges.

`lorafleet:step_running_requests`, `lorafleet:step_waiting_requests` and
`lorafleet:step_duration_seconds{path}` (worker/server/metrics.py), differenced between the scrape at
the window's start (after its warm-up) and at its end: mean running and waiting requests per engine
step, and the steps by path (graph, eager) with their mean wall time. Whether the batch was kept
full, and what the steps cost, in the worker's words rather than the client's.
"""

from __future__ import annotations

import threading
import time

import httpx

from bench.loadgen import Workload, run_load


def scrape(url: str) -> dict[str, float]:
    """The worker's step histograms' sums and counts (`lorafleet:step_*`), keyed by series."""
    try:
        text = httpx.get(url + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("lorafleet:step_") and ("_sum" in line or "_count" in line):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def worker_view(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the worker did between two scrapes: mean running and waiting requests per step, steps
    by path and their mean wall time (ms)."""
    def delta(prefix: str, suffix: str, path: str | None = None) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k.startswith(prefix + suffix) and (path is None or f'path="{path}"' in k))

    steps = delta("lorafleet:step_running_requests", "_count")
    view: dict = {"steps": int(steps)}
    if steps:
        view["mean_running"] = round(delta("lorafleet:step_running_requests", "_sum") / steps, 2)
        view["mean_waiting"] = round(delta("lorafleet:step_waiting_requests", "_sum") / steps, 2)
    for path in ("graph", "eager"):
        n = delta("lorafleet:step_duration_seconds", "_count", path)
        view[f"{path}_steps"] = int(n)
        if n:
            view[f"{path}_step_ms"] = round(1e3 * delta("lorafleet:step_duration_seconds", "_sum", path) / n, 2)
    return view


def windowed(url: str, w: Workload, processes: int, worker_url: str) -> tuple[dict, dict]:
    """run_load, and `worker_view` of its window (the worker's metrics scraped at its edges)."""
    marks: dict[str, dict] = {}
    threads: list[threading.Thread] = []

    def at(key: str, t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))
        marks[key] = scrape(worker_url)

    def hook(start_at: float) -> None:
        for key, t in (("before", start_at + w.warmup_s), ("after", start_at + w.duration_s)):
            threads.append(threading.Thread(target=at, args=(key, t), daemon=True))
            threads[-1].start()

    res = run_load(url, w, processes, on_start=hook)
    for t in threads:
        t.join()
    return res, worker_view(marks.get("before", {}), marks.get("after", {}))

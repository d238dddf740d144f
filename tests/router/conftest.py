"""Router test fixtures: fake workers in processes, the router in a uvicorn thread."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import uvicorn

from lorafleet.placement_store import PlacementStore
from lorafleet.router.api import create_app
from lorafleet.router.fast_http import server_config
from lorafleet.router.settings import RouterSettings
from tests.router.fake_worker import FakeWorkerConfig, FakeWorkerProcess, free_port, wait_http

ADMIN_TOKEN = "admin-secret"
CATALOG = {"a": "/adapters/a", "b": "/adapters/b", "c": "/adapters/c", "d": "/adapters/d"}


class RouterThread:
    """`create_app(settings)` served by real uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, settings: RouterSettings, store: PlacementStore | None = None) -> None:
        self.port = free_port()
        self.settings = replace(settings, host="127.0.0.1", port=self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(self.settings, store=store)
        # As `lorafleet router` serves it (router/fast_http.py; `fast_http=False`: plain uvicorn).
        config = server_config(self.app, self.settings, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RouterThread:
        self.thread.start()
        wait_http(self.url + "/health")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def metric(self, name: str, **labels: str) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def router_settings(workers: list[FakeWorkerProcess], **overrides) -> RouterSettings:
    base = RouterSettings(
        workers=tuple(w.worker_arg for w in workers),
        lora_modules=dict(CATALOG),
        admin_token=ADMIN_TOKEN,
        poll_interval_s=0.2,
        load_timeout_s=10.0,
        eject_cooldown_s=1.0,
    )
    return replace(base, **overrides)


def start_workers(specs: list[dict]) -> list[FakeWorkerProcess]:
    workers = [FakeWorkerProcess(FakeWorkerConfig(admin_token=ADMIN_TOKEN, **spec)) for spec in specs]
    procs = []
    try:
        for w in workers:
            procs.append(w.start())
    except Exception:
        for w in procs:
            w.kill()
        raise
    return workers


@pytest.fixture
def two_workers() -> Iterator[list[FakeWorkerProcess]]:
    """w0 holds a, w1 holds b; c and d are in the catalog but loaded nowhere."""
    workers = start_workers(
        [
            {"name": "w0", "lora_modules": {"a": CATALOG["a"]}},
            {"name": "w1", "lora_modules": {"b": CATALOG["b"]}},
        ]
    )
    yield workers
    for w in workers:
        w.kill()


@pytest.fixture
def redis_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """A private redis-server on a random port (the shared 6379 one is never stopped)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not installed: cannot start a Redis to stop")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)

"""Run the real worker app(s) under uvicorn on 127.0.0.1 random ports, each in its own thread."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.server.app import create_apps
from lorafleet.worker.server.settings import WorkerSettings
from tests.router.fake_worker import free_port, wait_http

TOKEN = "s3cret-admin-token"
# The public API suites' prompt and chat.
PROMPT = "The router sends each request to"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class ServerThread:
    def __init__(self, app: FastAPI, lifespan: str = "on", host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


class RunningWorker:
    """A worker (public app, plus an admin app when `admin_port` is asked for) until `stop()`."""

    def __init__(self, settings: WorkerSettings, host: str = "127.0.0.1", port: int = 0) -> None:
        public, admin = create_apps(settings)
        self.runtime = public.state.runtime
        self.public = ServerThread(public, host=host, port=port)
        self.admin = ServerThread(admin, lifespan="off") if admin is not None else None
        self.url = self.public.url
        self.admin_url = self.admin.url if self.admin else self.url

    def start(self) -> RunningWorker:
        self.public.start()
        if self.admin is not None:
            self.admin.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.url}/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready: {httpx.get(f'{self.url}/ready').text}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.stop()
        self.public.stop()

    @property
    def engine(self):
        """The LLMEngine (only touch it through `runtime.engine.call` while serving)."""
        return self.runtime.engine.engine


def worker_settings(demo_model: Path, adapters: dict[str, Path], token_file: Path | None = None,
                    adapter_root: Path | None = None, admin_port: bool = False, **engine: object) -> WorkerSettings:
    config = dict(max_loras=4, max_cpu_loras=8, max_loras_per_request=3, max_lora_rank=64, num_kv_blocks=256)
    config.update(engine)
    return WorkerSettings(
        model=str(demo_model), served_model_name="demo", lora_modules=tuple((n, str(p)) for n, p in adapters.items()),
        adapter_root=str(adapter_root) if adapter_root else None,
        admin_token_file=str(token_file) if token_file else None,
        admin_port=0 if admin_port else None, engine=EngineConfig(**config),
        freeze_gc=False,  # many workers start in this process: freezing each one's objects would pin them
    )


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def load_adapter(worker: RunningWorker, name: str, path: str, **extra: object) -> httpx.Response:
    """POST /v1/load_lora_adapter on the admin port, authenticated."""
    return httpx.post(f"{worker.admin_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      headers=auth(), timeout=60)


def adapter_inventory(worker: RunningWorker) -> dict[str, dict]:
    """The admin port's /v1/adapters by adapter name."""
    r = httpx.get(f"{worker.admin_url}/v1/adapters", headers=auth())
    assert r.status_code == 200, r.text
    return {a["name"]: a for a in r.json()["adapters"]}


def greedy_ids(worker: RunningWorker, model: str, prompt: str) -> tuple[int, list[str], list[float]]:
    """12 greedy tokens of `model` -> (status, tokens as `token_id:N`, their logprobs)."""
    r = httpx.post(f"{worker.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    if r.status_code != 200:
        return r.status_code, [], []
    lp = r.json()["choices"][0]["logprobs"]
    return 200, lp["tokens"], lp["token_logprobs"]


def serve(demo_model: Path, adapters: dict[str, Path], **settings: object) -> Iterator[RunningWorker]:
    """A module fixture's body: a worker on the demo model (`worker_settings`), stopped after."""
    w = RunningWorker(worker_settings(demo_model, adapters, **settings)).start()
    try:
        yield w
    finally:
        w.stop()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def start_cli_worker(flags: list[str], what: str, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """`lorafleet worker FLAGS --host 127.0.0.1 --port P` as a process, waited for until /ready (or
    until it exits): (the process, its URL). AssertionError naming `what`, with the end of its
    stderr, when it does not come up."""
    port = free_port()
    argv = [sys.executable, "-m", "lorafleet", "worker", *flags, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            wait_http(url + "/ready", timeout_s=1)
            return proc, url
        except TimeoutError:
            continue
    proc.kill()
    raise AssertionError(f"{what} did not start: {proc.communicate(timeout=30)[1].decode()[-2000:]}")

"""A stand-in stock vLLM server (its LoRA and listing endpoints) for operator tests.

The answers are vLLM 0.32's, as the real server gives them (tests/vllm/ runs the real one):
`/v1/*` needs `Authorization: Bearer <VLLM_API_KEY>` (401 otherwise); `/v1/adapters` does not
exist (404); `/v1/models` lists the base (`parent: null`) and each registered adapter (`parent`:
the base, `root`: its path); `POST /v1/load_lora_adapter` answers 200 text, 400 "has already been
loaded" for a name it holds (unless `load_inplace`), 404 for a path without an adapter; unload
answers 200 text, 404 for a name it does not hold; `/metrics` (open) has
`vllm:lora_requests_info`. Load/unload need `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (else 404).
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse


@dataclass(slots=True)
class FakeVllmState:
    api_key: str
    model: str = "base"
    max_loras: int = 1
    runtime_updates: bool = True
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    calls: list[tuple[str, str]] = field(default_factory=list)


def _error(status: int, message: str, type_: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status}},
                        status_code=status)


def create_app(state: FakeVllmState) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if not hmac.compare_digest(header.encode(), f"Bearer {state.api_key}".encode()):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:lora_requests_info gauge\n"
            f'vllm:lora_requests_info{{max_lora="{state.max_loras}",running_lora_adapters="",'
            f'waiting_lora_adapters=""}} {time.time()}\n'
            f'vllm:num_requests_running{{engine="0",model_name="{state.model}"}} 0.0\n')

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": state.model, "object": "model", "root": "/models/base", "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": state.model} for n, p in state.adapters.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        if not state.runtime_updates:
            return _error(404, "Not Found", "NotFoundError")
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        state.calls.append(("load", name))
        if name in state.adapters and not body.get("load_inplace"):
            return _error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not (Path(path) / "adapter_config.json").is_file():
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        state.adapters[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        if not state.runtime_updates:
            return _error(404, "Not Found", "NotFoundError")
        name = (await request.json())["lora_name"]
        state.calls.append(("unload", name))
        if state.adapters.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


class FakeVllm:
    """Runs the app with uvicorn on `host:port` as a task of the current event loop."""

    def __init__(self, state: FakeVllmState, host: str, port: int) -> None:
        self.state, self.host, self.port = state, host, port
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=3)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()

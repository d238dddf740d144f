"""A stand-in worker admin API (FastAPI) with the real worker's contract, for operator tests.

Implements `GET /v1/adapters`, `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`,
`/health`, `/ready`, bearer-token checked; `load_inplace` replaces other content unless requests
are in flight (409 `in_use`, as the real worker); `sha256` refuses other content (400
`DigestMismatch`, as the real worker). Adapters are directories under `adapter_root` with an
`adapter_config.json` (`r`, `lora_alpha`); the digest is sha256 over that file. Knobs inject the
failures the operator must survive: a worker that is down, restarts empty, answers 200 to an
unload and keeps the adapter (as vLLM has), or fails an adapter's loads (`load_faults`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse

from lorafleet.protocol import AdapterInfo, AdapterInventory, LoadLoraAdapterRequest, UnloadLoraAdapterRequest


@dataclass(slots=True)
class FakeWorkerState:
    token: str
    adapter_root: Path
    model: str = "base"
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    down: bool = False
    sticky_unload: bool = False  # unload answers 200 but keeps the adapter
    calls: list[tuple[str, str]] = field(default_factory=list)  # (op, adapter)
    # adapter -> (status, message, reason) every load of it answers, as a worker whose fetch of a
    # remote source fails (503 "unavailable" when the store keeps failing)
    load_faults: dict[str, tuple[int, str, str]] = field(default_factory=dict)

    def restart(self) -> None:
        self.adapters.clear()


def create_app(state: FakeWorkerState) -> FastAPI:
    app = FastAPI()

    def admin(authorization: str | None = Header(default=None)) -> None:
        if state.down:
            raise HTTPException(503, "worker restarting")
        expected = f"Bearer {state.token}"
        if authorization is None or not hmac.compare_digest(authorization.encode(), expected.encode()):
            raise HTTPException(401, "missing or wrong admin token")

    guarded = [Depends(admin)]

    @app.get("/health")
    async def health() -> dict:
        if state.down:
            raise HTTPException(503, "down")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict:
        return await health()

    @app.get("/v1/adapters", dependencies=guarded)
    async def adapters() -> AdapterInventory:
        return AdapterInventory(
            model=state.model, max_loras=state.max_loras, max_cpu_loras=state.max_cpu_loras,
            max_lora_rank=state.max_lora_rank, max_loras_per_request=4, adapters=list(state.adapters.values()),
        )

    @app.post("/v1/load_lora_adapter", dependencies=guarded)
    async def load(body: LoadLoraAdapterRequest) -> JSONResponse:
        state.calls.append(("load", body.lora_name))
        if body.lora_name in state.load_faults:
            code, message, reason = state.load_faults[body.lora_name]
            return _error(code, message, reason=reason)
        root = os.path.realpath(state.adapter_root)
        path = os.path.realpath(body.lora_path)
        if os.path.commonpath([root, path]) != root:
            return _error(400, f"lora_path {body.lora_path!r} is outside the adapter root")
        config_file = Path(path) / "adapter_config.json"
        if not config_file.is_file():
            return _error(400, f"no adapter_config.json in {body.lora_path!r}")
        raw = config_file.read_bytes()
        config = json.loads(raw)
        rank = int(config.get("r", 8))
        if rank > state.max_lora_rank:
            return _error(400, f"rank {rank} exceeds max_lora_rank {state.max_lora_rank}")
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        want = None if body.sha256 is None else "sha256:" + body.sha256.lower().removeprefix("sha256:")
        if want is not None and digest != want:  # as the real worker: refused before it serves
            return _error(400, f"digest mismatch for {body.lora_path}: expected {want}, got {digest}",
                          reason="DigestMismatch")
        old = state.adapters.get(body.lora_name)
        if old is not None and old.digest == digest:
            return JSONResponse({"status": "ok", "already_loaded": True})
        if old is not None and not body.load_inplace:
            return _error(409, f"{body.lora_name} is loaded with different content", reason="conflict")
        if old is not None and old.requests_in_flight:  # as the real worker: swap once they finish
            return _error(409, f"{body.lora_name} has requests in flight", reason="in_use")
        state.adapters.pop(body.lora_name, None)  # load_inplace: the new version replaces the old
        while len(state.adapters) >= state.max_cpu_loras:  # LRU eviction, as a real worker would
            state.adapters.pop(next(iter(state.adapters)))
        tier = "gpu" if len(state.adapters) < state.max_loras else "cpu"
        state.adapters[body.lora_name] = AdapterInfo(
            name=body.lora_name, tier=tier, rank=rank, alpha=float(config.get("lora_alpha", rank)),
            digest=digest, path=body.lora_path, last_used=time.time(),
        )
        return JSONResponse({"status": "ok"})

    @app.post("/v1/unload_lora_adapter", dependencies=guarded)
    async def unload(body: UnloadLoraAdapterRequest) -> JSONResponse:
        state.calls.append(("unload", body.lora_name))
        if body.lora_name not in state.adapters:
            return _error(404, f"{body.lora_name} is not loaded")
        if not state.sticky_unload:
            del state.adapters[body.lora_name]
        return JSONResponse({"status": "ok"})

    return app


def _error(code: int, message: str, reason: str | None = None) -> JSONResponse:
    error = {"message": message, "type": "invalid_request_error", "code": code}
    if reason is not None:
        error["reason"] = reason
    return JSONResponse({"error": error}, status_code=code)


class FakeWorker:
    """Runs the app with uvicorn on `host:port` as a task of the current event loop."""

    def __init__(self, state: FakeWorkerState, host: str, port: int) -> None:
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


def write_adapter(root: Path, name: str, rank: int = 8, alpha: float = 16.0) -> Path:
    """A fake adapter directory (config only; the fake worker never reads weights)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha, "peft_type": "LORA"}))
    return d

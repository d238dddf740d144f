"""A fake worker for router tests: the worker's HTTP API (issue 4) with canned generation.

Speaks the same wire models as the real worker (`lorafleet.protocol`): OpenAI completions and chat
(SSE streaming), `/v1/models`, `/v1/adapters`, bearer-protected load/unload with vLLM's shapes,
`/health`, `/ready`, `/metrics`. Generated text names the worker and the model so a test can see
where a request ran; `max_tokens` sets how many tokens it takes (`token_delay_s` each). A client
that disconnects aborts its request, as on the real worker. `/fake/stats` (test only) counts loads,
served requests and requests aborted by a disconnect;
`load_calls` counts every load request, also those joining a load under way.

Run as a process (so a test can kill it): `python tests/router/fake_worker.py --port P --name N
--lora-modules a=/adapters/a ...`; `FakeWorkerProcess` does that and waits for /health. Swap it
for the real `lorafleet worker` later: both expose the same endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import socket
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from lorafleet.protocol import (
    AdapterInfo,
    AdapterInventory,
    ErrorResponse,
    LoadLoraAdapterRequest,
    LoraAdapterRef,
    UnloadLoraAdapterRequest,
)


@dataclass(slots=True)
class FakeWorkerConfig:
    name: str = "w0"
    model: str = "demo-base"
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_loras_per_request: int = 2
    admin_token: str = "admin-secret"
    load_delay_s: float = 0.2
    token_delay_s: float = 0.005
    tokens: int = 4
    admin_port: int | None = None  # like `lorafleet worker --admin-port`: admin routes only there


ADMIN_PATHS = ("/v1/adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _err(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(ErrorResponse.of(message, type_, status).model_dump(), status_code=status)


def create_fake_worker(cfg: FakeWorkerConfig) -> FastAPI:
    app = FastAPI()
    resident: OrderedDict[str, str] = OrderedDict(cfg.lora_modules)  # name -> path, LRU order
    loads: Counter[str] = Counter()
    load_calls: Counter[str] = Counter()  # every authorized load request, joined or not
    served: Counter[str] = Counter()
    inflight: Counter[str] = Counter()
    aborted: Counter[str] = Counter()
    loading: dict[str, asyncio.Future[None]] = {}

    if cfg.admin_port is not None:

        @app.middleware("http")
        async def split_ports(request: Request, call_next):
            # Admin routes answer on the admin port only, everything else on the public port only.
            on_admin = request.scope["server"][1] == cfg.admin_port
            if request.url.path != "/health" and (request.url.path in ADMIN_PATHS) != on_admin:
                return _err(404, "Not Found", "not_found_error")
            return await call_next(request)

    def authorized(request: Request) -> bool:
        header = request.headers.get("authorization", "")
        return hmac.compare_digest(header.encode(), f"Bearer {cfg.admin_token}".encode())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict:
        return {"ready": True}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(f"vllm:num_requests_running {sum(inflight.values())}\n")

    @app.get("/fake/stats")
    async def stats() -> dict:
        return {
            "name": cfg.name,
            "loads": dict(loads),
            "load_calls": dict(load_calls),
            "served": dict(served),
            "aborted": dict(aborted),
            "resident": list(resident),
        }

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": cfg.model, "object": "model", "owned_by": "fake"}]
        data += [{"id": a, "object": "model", "owned_by": "fake", "parent": cfg.model} for a in resident]
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters(request: Request):
        if not authorized(request):  # the real worker keeps its inventory on the admin API
            return _err(401, "unauthorized", "authentication_error")
        names = list(resident)
        on_gpu = set(names[-cfg.max_loras :])  # the most recently used hold the GPU slots
        inv = AdapterInventory(
            model=cfg.model,
            max_loras=cfg.max_loras,
            max_cpu_loras=cfg.max_cpu_loras,
            max_lora_rank=16,
            max_loras_per_request=cfg.max_loras_per_request,
            num_requests_running=sum(inflight.values()),
            adapters=[
                AdapterInfo(
                    name=n,
                    tier="gpu" if n in on_gpu else "cpu",
                    rank=8,
                    alpha=16,
                    digest=f"sha256:{abs(hash(resident[n])):064x}"[:71],
                    path=resident[n],
                    requests_in_flight=inflight[n],
                )
                for n in names
            ],
        )
        return inv.model_dump()

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        if not authorized(request):
            return _err(401, "unauthorized", "authentication_error")
        body = LoadLoraAdapterRequest.model_validate(await request.json())
        load_calls[body.lora_name] += 1
        if body.lora_path.startswith("/refuse/"):  # refused as the real worker does: its message names the file
            refused = _err(400, f"{body.lora_path}/adapter_config.json: not a LoRA adapter")
            payload = json.loads(refused.body)
            payload["error"]["reason"] = "invalid_config"
            return JSONResponse(payload, status_code=400)
        if body.lora_name in resident:
            if resident[body.lora_name] != body.lora_path:
                return _err(409, f"adapter {body.lora_name!r} already loaded from another path")
            return PlainTextResponse("ok")
        if body.lora_name in loading:  # concurrent identical loads load once
            await loading[body.lora_name]
            return PlainTextResponse("ok")
        loading[body.lora_name] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.sleep(cfg.load_delay_s)
            while len(resident) >= cfg.max_cpu_loras:
                victim = next((n for n in resident if inflight[n] == 0), None)
                if victim is None:
                    break
                del resident[victim]
            resident[body.lora_name] = body.lora_path
            loads[body.lora_name] += 1
        finally:
            loading.pop(body.lora_name).set_result(None)
        return PlainTextResponse("ok")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        if not authorized(request):
            return _err(401, "unauthorized", "authentication_error")
        body = UnloadLoraAdapterRequest.model_validate(await request.json())
        if resident.pop(body.lora_name, None) is None:
            return _err(404, f"adapter {body.lora_name!r} not loaded")
        return PlainTextResponse("ok")

    async def generate(request: Request, chat: bool):
        if request.headers.get("authorization"):
            return _err(400, "the router must not forward client API keys")
        payload = await request.json()
        model = payload.get("model")
        if model == cfg.model:
            names = [LoraAdapterRef.model_validate(r).name for r in payload.get("lora_adapters") or []]
        else:
            names = [model]
        if len(names) > cfg.max_loras_per_request:  # the real worker's refusal
            return _err(400, f"{len(names)} adapters requested; this worker allows "
                             f"max_loras_per_request={cfg.max_loras_per_request}")
        missing = [n for n in names if n not in resident]
        if missing:
            return _err(404, f"The model `{missing[0]}` does not exist.")
        for n in names:
            resident.move_to_end(n)
            inflight[n] += 1
        served[model] += 1
        max_tokens = payload.get("max_tokens")
        tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else cfg.tokens
        text = f"[{cfg.name}] {model}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        tenant = request.headers.get("x-lorafleet-tenant", "")

        def done() -> None:
            for n in names:
                inflight[n] -= 1

        if not payload.get("stream"):
            try:
                for _ in range(tokens):
                    await asyncio.sleep(cfg.token_delay_s)
                    if await request.is_disconnected():
                        aborted[model] += 1
                        return _err(499, "client disconnected")
            finally:
                done()
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            )
            usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
            return JSONResponse(
                {
                    "id": "cmpl-fake",
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                },
                headers={"x-fake-tenant": tenant},
            )

        async def events():
            finished = False
            try:
                pieces = [f"[{cfg.name}]"] + [f" {model}"] + [""] * max(0, tokens - 2)
                for i, piece in enumerate(pieces):
                    await asyncio.sleep(cfg.token_delay_s)
                    last = i == len(pieces) - 1
                    if chat:
                        delta = {"content": piece} if i else {"role": "assistant", "content": piece}
                        choice = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
                    else:
                        choice = {"index": 0, "text": piece, "finish_reason": "stop" if last else None}
                    chunk = {
                        "id": "cmpl-fake",
                        "object": kind + ".chunk",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:  # cancelled: the client went away mid-stream
                    aborted[model] += 1
                done()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


class FakeWorkerProcess:
    """A fake worker in its own process on 127.0.0.1 (so a test can SIGKILL it)."""

    def __init__(self, cfg: FakeWorkerConfig, port: int | None = None) -> None:
        self.cfg = cfg
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{cfg.admin_port}" if cfg.admin_port else self.url
        self.proc: subprocess.Popen | None = None

    @property
    def worker_arg(self) -> str:
        """The router's `--worker` entry for this worker."""
        return self.url if self.admin_url == self.url else f"{self.url},admin={self.admin_url}"

    def start(self) -> FakeWorkerProcess:
        args = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--port",
            str(self.port),
            "--name",
            self.cfg.name,
        ]
        args += ["--model", self.cfg.model, "--max-loras", str(self.cfg.max_loras)]
        args += ["--max-cpu-loras", str(self.cfg.max_cpu_loras), "--admin-token", self.cfg.admin_token]
        args += ["--max-loras-per-request", str(self.cfg.max_loras_per_request)]
        args += ["--load-delay", str(self.cfg.load_delay_s), "--token-delay", str(self.cfg.token_delay_s)]
        if self.cfg.admin_port:
            args += ["--admin-port", str(self.cfg.admin_port)]
        args += ["--lora-modules", *[f"{k}={v}" for k, v in self.cfg.lora_modules.items()]]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(self.url + "/health")
        wait_http(self.admin_url + "/health")
        return self

    def stats(self) -> dict:
        return httpx.get(self.url + "/fake/stats", timeout=2).json()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="w0")
    p.add_argument("--model", default="demo-base")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-cpu-loras", type=int, default=8)
    p.add_argument("--max-loras-per-request", type=int, default=2)
    p.add_argument("--admin-token", default="admin-secret")
    p.add_argument("--load-delay", type=float, default=0.2)
    p.add_argument("--token-delay", type=float, default=0.005)
    p.add_argument("--admin-port", type=int, default=None)
    p.add_argument("--lora-modules", nargs="*", default=[])
    a = p.parse_args(argv)
    cfg = FakeWorkerConfig(
        name=a.name,
        model=a.model,
        lora_modules=dict(item.split("=", 1) for item in a.lora_modules),
        max_loras=a.max_loras,
        max_cpu_loras=a.max_cpu_loras,
        max_loras_per_request=a.max_loras_per_request,
        admin_token=a.admin_token,
        load_delay_s=a.load_delay,
        token_delay_s=a.token_delay,
        admin_port=a.admin_port,
    )
    import uvicorn

    app = create_fake_worker(cfg)
    ports = [a.port] + ([a.admin_port] if a.admin_port else [])
    servers = [
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        for port in ports
    ]

    async def serve() -> None:
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve())


if __name__ == "__main__":
    main()

"""The router in front of two real `lorafleet worker` processes (CPU, demo assets), `openai` client."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.router.conftest import RouterThread
from tests.router.fake_worker import free_port, wait_http

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKEN = "router-test-admin-token"


class WorkerProcess:
    def __init__(
        self,
        model: Path,
        adapter_root: Path,
        token_file: Path,
        modules: dict[str, Path],
        admin_port: int | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}" if admin_port else self.url
        args = [
            sys.executable,
            "-m",
            "lorafleet",
            "worker",
            "--model",
            str(model),
            "--served-model-name",
            "demo",
        ]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32"]
        args += [
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "4",
            "--max-lora-rank",
            "64",
            "--max-loras-per-request",
            "2",
        ]
        args += [
            "--adapter-root",
            str(adapter_root),
            "--admin-token-file",
            str(token_file),
            "--log-level",
            "warning",
        ]
        if admin_port:  # as the operator runs workers: the admin API only on its own port
            args += ["--admin-port", str(admin_port)]
        args += ["--lora-modules", *[f"{k}={v}" for k, v in modules.items()]]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                wait_http(self.url + "/ready", timeout_s=1)
                return
            except TimeoutError:
                continue
        self.kill()
        raise RuntimeError(
            self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else "worker did not start"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def test_router_with_two_real_workers(demo_assets: Path, tmp_path: Path):
    adapters = {p.name: p for p in (demo_assets / "adapters").iterdir() if p.is_dir()}
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    w0 = WorkerProcess(
        demo_assets / "model", demo_assets / "adapters", token_file, {"sql": adapters["sql"]}, free_port()
    )
    w1 = WorkerProcess(
        demo_assets / "model", demo_assets / "adapters", token_file, {"chat": adapters["chat"]}
    )
    try:
        w0.wait_ready()
        w1.wait_ready()
        from lorafleet.router.settings import RouterSettings

        settings = RouterSettings(
            workers=(f"{w0.url},admin={w0.admin_url}", w1.url),
            lora_modules={name: str(path) for name, path in adapters.items()},
            admin_token_file=token_file,
            poll_interval_s=0.2,
        )
        with RouterThread(settings) as router:
            c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)

            def ask(model: str) -> tuple[str, str]:
                raw = c.completions.with_raw_response.create(
                    model=model, prompt="Hello", max_tokens=4, temperature=0
                )
                return raw.headers["x-lorafleet-replica"], raw.parse().choices[0].text

            assert ask("sql")[0] == f"127.0.0.1:{w0.port}"
            assert ask("chat")[0] == f"127.0.0.1:{w1.port}"
            # A cold adapter: several concurrent requests, one load, the same answer at temperature 0.
            with ThreadPoolExecutor(4) as pool:
                cold = list(pool.map(lambda _: ask("poem"), range(4)))
            assert len({r for r, _ in cold}) == 1 and len({t for _, t in cold}) == 1
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert httpx.get(w0.url + "/v1/adapters", headers=auth).status_code == 404  # admin port only
            inventories = [httpx.get(w.admin_url + "/v1/adapters", headers=auth).json() for w in (w0, w1)]
            holders = [inv for inv in inventories if any(a["name"] == "poem" for a in inv["adapters"])]
            assert len(holders) == 1
            # Streaming passes through.
            stream = c.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
            assert sum(1 for _ in stream) >= 2
            # Kill the worker that holds sql: sql is loaded on the survivor and nothing is lost.
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(ask, "sql" if i % 2 else "chat") for i in range(16)]
                time.sleep(0.2)
                w0.kill()
                results = [f.result() for f in futures]
            assert len(results) == 16
            assert ask("sql")[0] == f"127.0.0.1:{w1.port}"
    finally:
        w0.kill()
        w1.kill()

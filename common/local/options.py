"""The options of `lorafleet up` and its command line, plus the fixed names of the local fleet."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.cli_help import WORKER_ENV, finish
from lorafleet.local.preflight import FleetError
from lorafleet.local.run_dir import DEFAULT_RUN_DIR
from lorafleet.worker.server.vllm_flags import DTYPE_ALIASES, DTYPES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SERVED_NAME = "tiny-llama"
POOL = "local"


@dataclass(frozen=True, slots=True)
class UpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 2
    device: str = "cpu"
    assets: Path = field(default_factory=lambda: default_assets_dir())
    run_dir: Path = DEFAULT_RUN_DIR
    redis_url: str | None = DEFAULT_REDIS_URL  # None: embedded state without trying Redis
    worker_port: int | None = None  # first worker port; None: free ports picked by the OS
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_lora_rank: int = 64
    # The workers' model flags, passed as given (None / 1: the worker's own default).
    dtype: str | None = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    ready_timeout_s: float = 180.0
    log_level: str = "warning"


def default_assets_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lorafleet" / "demo-assets"


def build_parser() -> argparse.ArgumentParser:
    d = UpOptions()
    p = argparse.ArgumentParser(prog="lorafleet up", description="Start a local fleet: the router, CPU workers "
                                "and a tiny demo model with LoRA adapters. Ctrl-C stops everything.")
    p.add_argument("--port", type=int, default=d.port, help="router port (default 8000)")
    p.add_argument("--host", default=d.host, help="bind address of the router and workers (default 127.0.0.1)")
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes (default 2)")
    p.add_argument("--device", default=d.device, help="cpu (default) or cuda: workers spread over the visible GPUs")
    p.add_argument("--assets", type=Path, default=None,
                   help=f"demo model and adapters; made here if absent (default {d.assets})")
    p.add_argument("--run-dir", type=Path, default=d.run_dir,
                   help="state, admin token, adapter volume and logs of this fleet (default .lorafleet)")
    p.add_argument("--redis-url", default=d.redis_url,
                   help=f"placement store when it answers (default {DEFAULT_REDIS_URL}); else embedded state")
    p.add_argument("--no-redis", action="store_true", help="embedded in-process state even if Redis answers")
    p.add_argument("--worker-port", type=int, default=None, help="first worker port (default: free ports)")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help=f"adapters per batch on each worker (default {d.max_loras})")
    p.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                   help=f"adapters each worker holds (default {d.max_cpu_loras})")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help=f"largest adapter rank the workers load (default {d.max_lora_rank})")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="the workers' --dtype (default: float32 on CPU, for exact answers; theirs, vLLM's auto, "
                        "on CUDA; vLLM's names: half = float16, float = float32)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="the workers' --quantization: fp8 serves the model's projections in FP8 (e4m3), "
                        "adapters in --dtype (default: the checkpoint's weights as stored)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="the workers' --tensor-parallel-size: each worker's model over N processes (on CUDA "
                        "its ranks take cuda:0..N-1, so one worker)")
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout_s,
                   help=f"seconds to wait for the fleet (default {d.ready_timeout_s:g})")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="log level of this process and the workers")
    return finish(p, {
        "Fleet": ["--workers", "--device", "--assets", "--run-dir", "--ready-timeout", "--log-level"],
        "Network": ["--port", "--host", "--worker-port"],
        "Placement store": ["--redis-url", "--no-redis"],
        "Workers' model": ["--dtype", "--quantization", "--tensor-parallel-size"],
        "Workers' adapters": ["--max-loras", "--max-cpu-loras", "--max-lora-rank"],
    }, ("XDG_CACHE_HOME", *WORKER_ENV))


def options_from_args(args: argparse.Namespace) -> UpOptions:
    """The options, checked before anything starts (a worker refusing them would say so only in its log)."""
    from lorafleet.worker.config import ConfigError, EngineConfig  # torch-free

    if args.workers < 1:
        raise FleetError("--workers must be at least 1")
    for flag, port in (("--port", args.port), ("--worker-port", args.worker_port)):
        if port is not None and not 1 <= port <= 65535:
            raise FleetError(f"{flag} {port}: a port is 1..65535")
    if args.worker_port is not None and args.worker_port + args.workers - 1 > 65535:
        raise FleetError(f"--worker-port {args.worker_port}: {args.workers} workers need ports up to "
                         f"{args.worker_port + args.workers - 1}, past 65535")
    if not args.ready_timeout > 0:
        raise FleetError(f"--ready-timeout {args.ready_timeout:g}: must be more than 0 seconds")
    if args.tensor_parallel_size > 1 and args.quantization:  # the engine's rule, said before anything starts
        raise FleetError(f"--quantization {args.quantization} with --tensor-parallel-size {args.tensor_parallel_size}: "
                         "FP8 weights are served on one device only")
    if args.tensor_parallel_size > 1 and args.device.startswith("cuda") and args.workers > 1:
        raise FleetError(f"--tensor-parallel-size {args.tensor_parallel_size} on CUDA: each worker's ranks take "
                         f"cuda:0..{args.tensor_parallel_size - 1}, so --workers 1 (got {args.workers})")
    try:
        EngineConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                     dtype=DTYPE_ALIASES.get(args.dtype, args.dtype or "auto"), quantization=args.quantization,
                     tensor_parallel_size=args.tensor_parallel_size)
    except ConfigError as exc:  # the workers' own rules, said with the flags (and their values)
        values = f"--max-loras {args.max_loras}, --max-cpu-loras {args.max_cpu_loras}, --max-lora-rank {args.max_lora_rank}"
        if "tensor_parallel" in str(exc):
            values = f"--tensor-parallel-size {args.tensor_parallel_size}"
        raise FleetError(f"{str(exc).replace('_', '-')} ({values})") from None
    return UpOptions(
        host=args.host, port=args.port, workers=args.workers, device=args.device,
        assets=args.assets or default_assets_dir(), run_dir=args.run_dir,
        redis_url=None if args.no_redis else args.redis_url, worker_port=args.worker_port,
        max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
        dtype=args.dtype, quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
        ready_timeout_s=args.ready_timeout, log_level=args.log_level,
    )

"""The engine's device-dependent settings: `EngineConfig`'s choices (and its `auto`s) resolved
against the device.

The dtype (auto: float32 on CPU, the checkpoint's half type on CUDA), the LoRA backend (auto:
Triton on CUDA where it imports), the cuBLAS library torch's matmuls go through
(`LORAFLEET_BLAS`), and whether decode steps run CUDA graphs and async scheduling.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.envs import interpreting
from lorafleet.worker.config import ConfigError, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    return DTYPES.get(model.torch_dtype, torch.bfloat16) if model.torch_dtype != "float32" else torch.bfloat16


def resolve_lora_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_ready() else "torch"
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise ConfigError("the triton LoRA backend needs --device cuda (or TRITON_INTERPRET=1)")
    return name


def prefer_blas(name: str) -> None:
    """The cuBLAS API torch's matmuls go through (process-wide). cuBLASLt by default: on the H200 its
    decode GEMMs at batch 64 are faster (mlp down 36.5 -> 32.1 µs, gate_up 61.4 -> 58.7 µs; qkv the
    same) and it honours an SM carveout; LORAFLEET_BLAS=cublas keeps torch's default."""
    if name not in ("cublas", "cublaslt"):
        raise ConfigError(f"LORAFLEET_BLAS must be cublas or cublaslt, got {name!r}")
    torch.backends.cuda.preferred_blas_library(name)


def want_cuda_graphs(setting: bool | None, device: torch.device, attention_backend: str, lora_backend: str) -> bool:
    """EngineConfig.cuda_graphs resolved: None = on for CUDA with the Triton backends."""
    triton_paths = attention_backend == "triton" and lora_backend == "triton"
    if setting is None:
        return device.type == "cuda" and triton_paths
    if setting and device.type == "cuda" and not triton_paths:
        raise ConfigError(
            "--cuda-graphs needs the triton attention and LoRA backends on CUDA (got attention "
            f"{attention_backend}, LoRA {lora_backend}): the torch paths read host lists"
        )
    return setting


def want_async_scheduling(setting: bool | None, has_graphs: bool, device: torch.device) -> bool:
    """EngineConfig.async_scheduling resolved: None = on where decode steps replay captured
    CUDA graphs (on CPU the graph path runs uncaptured, for tests: off unless asked)."""
    if setting is None:
        return has_graphs and device.type == "cuda"
    return setting


def _triton_ready() -> bool:
    try:
        import lorafleet.kernels.lora.launch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: use the reference path
        return False
    return True

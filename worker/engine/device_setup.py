"""The engine's device-dependent settings: `EngineConfig`'s choices (and its `auto`s) resolved
against the device.

The dtype (auto: vLLM's, the checkpoint's half type, bfloat16 for a float32 one; unset: float32 on
CPU), the defaults `lorafleet worker` takes from vLLM 0.32 per device (`resolve_device_defaults`:
sequences and tokens per step by GPU memory, the KV block size), the LoRA backend (auto: Triton on
CUDA where it imports), the cuBLAS library torch's matmuls go through (`LORAFLEET_BLAS`), and
whether decode steps run CUDA graphs and async scheduling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lorafleet.kernels.envs import interpreting
from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Families vLLM never runs in float16 (numerical instability): auto falls back to bfloat16.
NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text"})
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What vLLM's defaults depend on: the device's kind, name and total memory (bytes), and
    whether it computes in bfloat16 (CUDA: compute capability 8.0 or above)."""

    kind: str  # "cpu" | "cuda"
    name: str = ""
    total_memory: int = 0
    bf16: bool = True


def device_info(device: torch.device) -> DeviceInfo:
    """The engine's device, as `DeviceInfo` (the one place that asks CUDA)."""
    if device.type != "cuda":
        return DeviceInfo("cpu")
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo("cuda", props.name, props.total_memory, props.major >= 8)


def resolve_dtype(name: str | None, model: ModelConfig, device: torch.device, bf16: bool = True) -> torch.dtype:
    """`EngineConfig.dtype` on `device`. auto is vLLM 0.32's (`_resolve_auto_dtype`): the checkpoint's
    type where it is a half type the device (and the family) takes, else the device's preferred half
    type, bfloat16 (float16 where bf16 is False); so a float32 checkpoint runs in bfloat16, on CPU too.
    None keeps float32 on CPU, where tests compare with transformers exactly, and is auto on CUDA."""
    if name is not None and name != "auto":
        return DTYPES[name]
    if name is None and device.type == "cpu":
        return torch.float32
    supported = [t for t in (torch.bfloat16, torch.float16, torch.float32) if (bf16 or t != torch.bfloat16)
                 and not (t == torch.float16 and model.model_type in NO_FLOAT16)]
    checkpoint = DTYPES.get(model.torch_dtype, torch.float32)
    if checkpoint == torch.float32 or checkpoint not in supported:
        return supported[0]
    return checkpoint


def vllm_batch_defaults(info: DeviceInfo, world_size: int = 1) -> tuple[int, int]:
    """vLLM 0.32's OpenAI server's (max_num_seqs, max_num_batched_tokens) for a device, before its
    caps (`EngineArgs.get_batch_defaults`, usage context OPENAI_API_SERVER): on CPU 128 and 2048 per
    rank; from 160 GiB (B200) 1024 and 16384; from 70 GiB but an A100 (H100, H200) 1024 and 8192;
    other GPUs 256 and 2048."""
    if info.kind == "cpu":
        return 128 * world_size, 2048 * world_size
    if info.total_memory >= 160 * GIB:
        return 1024, 16384
    if info.total_memory >= 70 * GIB and "a100" not in info.name.lower():
        return 1024, 8192
    return 256, 2048


def vllm_block_size(info: DeviceInfo) -> int:
    """vLLM 0.32's KV block size: 16 (CacheConfig's, which its CUDA attention backends take); 128 on
    CPU (CpuPlatform.check_and_update_config)."""
    return 128 if info.kind == "cpu" else 16


def resolve_device_defaults(config: EngineConfig, info: DeviceInfo, max_model_len: int) -> EngineConfig:
    """`config` with its unset (None) block size, sequences and token budget given vLLM 0.32's values
    for the device, and vLLM's caps on them when unset: the token budget at most max_num_seqs x
    max_model_len, max_num_seqs at most the token budget (`_set_default_max_num_seqs_and_batched_tokens_args`)."""
    seqs, tokens = vllm_batch_defaults(info, config.tensor_parallel_size)
    max_num_seqs = config.max_num_seqs if config.max_num_seqs is not None else seqs
    batched = config.max_num_batched_tokens
    if batched is None:
        batched = min(max_num_seqs * max_model_len, tokens)
    if config.max_num_seqs is None:
        max_num_seqs = min(max_num_seqs, batched)
    block_size = config.block_size if config.block_size is not None else vllm_block_size(info)
    return dataclasses.replace(config, max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, block_size=block_size)


def resolved_defaults_line(config: EngineConfig, resolved: EngineConfig, info: DeviceInfo) -> str | None:
    """What start-up logs about the defaults it took from vLLM for this device (None: all given)."""
    picks = [(flag, getattr(resolved, field)) for flag, field in (
        ("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens"),
        ("--block-size", "block_size")) if getattr(config, field) is None]
    if not picks:
        return None
    device = "CPU" if info.kind == "cpu" else f"{info.name} ({info.total_memory / GIB:.0f} GiB)"
    return f"vLLM 0.32's defaults for {device}: " + ", ".join(f"{flag} {value}" for flag, value in picks)


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

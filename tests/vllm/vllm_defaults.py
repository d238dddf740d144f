"""Run in vLLM's virtualenv (not ours): vLLM 0.32's own default-resolving code on a table of devices
given as JSON on stdin, with its platform replaced by each device's figures, and print what it
resolves: the OpenAI server's `max_num_seqs` and `max_num_batched_tokens`
(`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`, which calls `get_batch_defaults`),
CacheConfig's default block size (CUDA's) and the one CpuPlatform sets when none is given, and
`--dtype auto` for a few checkpoints (`_resolve_auto_dtype`). Imports nothing of lorafleet."""

import inspect
import json
import re
import sys
from types import SimpleNamespace

import torch
import vllm.config.model as model_config_module
import vllm.engine.arg_utils as arg_utils
from vllm.config.cache import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.cpu import CpuPlatform
from vllm.usage.usage_lib import UsageContext

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class Platform:
    """The few questions vLLM's default code asks its platform, answered for one device."""

    def __init__(self, device: dict) -> None:
        self.device = device

    def is_cpu(self) -> bool:
        return self.device["kind"] == "cpu"

    def is_tpu(self) -> bool:
        return False

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.device["total_memory"]

    def get_device_name(self, device_id: int = 0) -> str:
        return self.device["name"]

    def get_device_capability(self, device_id: int = 0):
        return None

    @property
    def supported_dtypes(self) -> list:
        if self.is_cpu() or self.device["bf16"]:  # x86 and aarch64 Linux CPUs; CUDA from capability 8.0
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]


def batch(device: dict) -> dict:
    arg_utils.current_platform = Platform(device)
    args = EngineArgs(model="/models/m", max_num_seqs=device.get("max_num_seqs"),
                      max_num_batched_tokens=device.get("max_num_batched_tokens"),
                      tensor_parallel_size=device.get("world_size", 1))
    args.enable_chunked_prefill = True
    model = SimpleNamespace(max_model_len=device["max_model_len"], is_multimodal_model=False, is_mm_prefix_lm=False)
    args._set_default_max_num_seqs_and_batched_tokens_args(
        UsageContext.OPENAI_API_SERVER, model, SimpleNamespace(use_batched_dp_moe=False))
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}


def dtypes(device: dict) -> dict:
    model_config_module.current_platform = Platform(device)
    out = {}
    for family, checkpoint in device.get("checkpoints", []):
        torch_type = getattr(torch, checkpoint)
        got = model_config_module._resolve_auto_dtype(family, torch_type, is_pooling_model=False)
        out[f"{family}/{checkpoint}"] = DTYPE_NAMES[got]
    return out


def cpu_block_size() -> int | None:
    """The block size CpuPlatform.check_and_update_config sets when --block-size is not given (read
    from its source: running it needs a whole VllmConfig)."""
    source = inspect.getsource(CpuPlatform.check_and_update_config)
    match = re.search(r"elif not cache_config\.user_specified_block_size:\s*cache_config\.block_size = (\d+)", source)
    return int(match.group(1)) if match else None


devices = json.loads(sys.stdin.read())
print(json.dumps({"cuda_block_size": CacheConfig.DEFAULT_BLOCK_SIZE, "cpu_block_size": cpu_block_size(),
                  "devices": [batch(d) | {"dtypes": dtypes(d)} for d in devices]}))

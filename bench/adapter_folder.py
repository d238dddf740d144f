"""A random PEFT adapter folder on disk, and how much of a file the page cache holds.

The adapter is rank r on all 7 projections at the model's shape (80 MiB in bf16 at rank 16 on the
seed shape), written as a real PEFT folder: adapter_config.json + adapter_model.safetensors under
PEFT's tensor names. The folder is fsynced and, on request, dropped from the page cache
(posix_fadvise DONTNEED, no root needed); cached_fraction() asks mincore how much of a file is
still cached.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch

from bench.engine_build import TARGETS
from lorafleet.worker.config import ModelConfig
from lorafleet.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE


def peft_tensors(config: ModelConfig, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 LoRA weights under PEFT's saved names (A [r, in], B [out, r])."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for t in TARGETS:
            out, in_ = config.linear_shape(t)
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[p + ".lora_A.weight"] = torch.randn(rank, in_, generator=g, dtype=torch.bfloat16) * 0.01
            tensors[p + ".lora_B.weight"] = torch.randn(out, rank, generator=g, dtype=torch.bfloat16) * 0.01
    return tensors


def peft_config(rank: int) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "lorafleet-bench-random",
            "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "lora_dropout": 0.0,
            "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "init_lora_weights": True}


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], rank: int, drop_cache: bool) -> None:
    """Write a PEFT folder and fsync it; with `drop_cache` also ask the kernel to drop its pages."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps(peft_config(rank), indent=2))
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            if drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore); None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, 1, 1, f.fileno(), 0)  # PROT_READ, MAP_SHARED: faults nothing in
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * -(-size // page))()
            if libc.mincore(addr, size, vec) != 0:
                return None
        finally:
            libc.munmap(addr, size)
        return sum(b & 1 for b in bytes(vec)) / len(vec)
    except (OSError, AttributeError, ValueError):
        return None

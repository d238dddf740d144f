"""Helpers for the adapter load path tests: PEFT folders with random weights, registries with slots
on the CPU or CUDA, and the reference the slots are compared with.

The reference is the per-tensor preparation and fill the registry used before the packed layout
(scale B in float32, round to the slot dtype, copy A rows and B^T into the slot), module by module:
`reference_slot` says what a slot should hold, `assert_slot_equals` compares it bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafleet.worker.config import FUSED_SLICES, EngineConfig, ModelConfig
from lorafleet.worker.lora.adapter import LoraWeights, ModuleWeights
from lorafleet.worker.lora.packing import SLICE_ORDER
from lorafleet.worker.lora.registry import AdapterRegistry
from lorafleet.worker.lora.slots import LoraSlots

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_registry(model: ModelConfig, dtype: torch.dtype, max_loras: int = 3, max_rank: int = 64) -> AdapterRegistry:
    cfg = EngineConfig(max_loras=max_loras, max_cpu_loras=8, max_lora_rank=max_rank, max_loras_per_request=1)
    slots = LoraSlots(model, max_loras, max_rank, torch.device("cpu"), dtype)
    return AdapterRegistry(model, cfg, slots, dtype)


def make_cuda_registry(model: ModelConfig, dtype: torch.dtype, max_loras: int = 2) -> AdapterRegistry:
    cfg = EngineConfig(max_loras=max_loras, max_cpu_loras=8, max_lora_rank=64, max_loras_per_request=1,
                       device="cuda")
    slots = LoraSlots(model, max_loras, 64, torch.device("cuda"), dtype)
    return AdapterRegistry(model, cfg, slots, dtype)


def write_adapter(folder: Path, model: ModelConfig, dtype: torch.dtype, *, r: int = 8, alpha: float = 24.0,
                  targets=SLICE_ORDER, seed: int = 0, layers=None, **cfg_extra) -> Path:
    """A PEFT folder with random weights in `dtype` (the given layers, default all, and targets);
    rank_pattern keys match as PEFT (and the loader) match them, so per-layer keys work."""
    g = torch.Generator().manual_seed(seed)
    rank_pattern = cfg_extra.get("rank_pattern", {})
    tensors = {}
    for layer in range(model.num_layers) if layers is None else layers:
        for t in targets:
            out, in_ = model.linear_shape(t)
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            rr = _pattern_value(rank_pattern, f"model.layers.{layer}.{block}.{t}", r)
            p = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[p + ".lora_A.weight"] = (torch.randn(rr, in_, generator=g) * 0.3).to(dtype)
            tensors[p + ".lora_B.weight"] = (torch.randn(out, rr, generator=g) * 0.3).to(dtype)
    folder.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           **cfg_extra}
    (folder / CONFIG).write_text(json.dumps(cfg))
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    return folder


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's own rule (`get_pattern_key`): the value of the first key matching the module name's end."""
    if not patterns:
        return default
    from peft.utils.other import get_pattern_key

    return patterns.get(get_pattern_key(list(patterns), module), default)


def reference_slot(weights, model: ModelConfig, dtype: torch.dtype):
    """What the old path put in a slot: {(layer, fused, j): (rank, A rows, B [out, r])}."""
    want = {}
    for layer in range(model.num_layers):
        for fused, names in FUSED_SLICES.items():
            for j, target in enumerate(names):
                m = weights.modules.get((layer, target))
                if m is None:
                    want[(layer, fused, j)] = (0, None, None)
                    continue
                a, b = m.a, m.b
                if m.scaling != 1.0 or a.dtype != dtype:  # the old _prepare
                    b = (b.float() * m.scaling).to(dtype)
                    a = a.to(dtype)
                want[(layer, fused, j)] = (a.shape[0], a.to(dtype), b.to(dtype))  # the old fill's copy_
    return want


def assert_slot_equals(slots: LoraSlots, slot: int, want) -> None:
    for (layer, fused, j), (r, a, b) in want.items():
        s = slots.layers[layer][fused]
        assert s.ranks[j][slot] == r, (layer, fused, j)
        assert int(s.ranks_device[j, slot]) == r, (layer, fused, j)
        if r:
            assert torch.equal(s.lora_a[j][slot, :r].cpu(), a), (layer, fused, j)
            assert torch.equal(s.lora_b[j][slot, :, :r].cpu(), b), (layer, fused, j)


def layout_folders(model: ModelConfig, demo_adapters, tmp_path: Path, dtype: torch.dtype) -> dict[str, Path]:
    """The demo adapters, a file already in `dtype` (the fast B path), rsLoRA with rank and alpha
    patterns, and a full-rank-64 one."""
    folders = dict(demo_adapters)
    folders["native"] = write_adapter(tmp_path / "native", model, dtype, r=8, alpha=20.0)
    folders["patterns"] = write_adapter(tmp_path / "patterns", model, torch.bfloat16, r=16, alpha=7.0, seed=1,
                                        use_rslora=True, rank_pattern={"k_proj": 4, "down_proj": 2},
                                        alpha_pattern={"up_proj": 3.0}, targets=("k_proj", "up_proj", "down_proj"))
    folders["wide"] = write_adapter(tmp_path / "wide", model, torch.float32, r=64, alpha=64.0, seed=2,
                                    targets=("o_proj",))
    return folders


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def random_weights(model: ModelConfig, r: int, dtype=torch.bfloat16, ranks=None, seed: int = 0) -> LoraWeights:
    """In-memory weights on every layer and target; `ranks(layer, target)` overrides r."""
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(model.num_layers):
        for t in SLICE_ORDER:
            out, in_ = model.linear_shape(t)
            rr = ranks(layer, t) if ranks else r
            mods[(layer, t)] = ModuleWeights(a=torch.randn(rr, in_, generator=g).to(dtype),
                                             b=torch.randn(out, rr, generator=g).to(dtype), scaling=2.0)
    return LoraWeights(path="mem", rank=r, alpha=2.0 * r, use_rslora=False, digest="mem", modules=mods)

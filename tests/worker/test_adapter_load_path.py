"""The adapter load path: one read (digest + parse), the packed slot layout, and the NaN/Inf check.

The slot contents a packed fill produces are compared, bit for bit, with a straightforward
reference: the per-tensor preparation and fill the registry used before the packed layout
(scale B in float32, round to the slot dtype, copy A rows and B^T into the slot).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.config import FUSED_SLICES, EngineConfig, ModelConfig
from lorafleet.worker.lora import adapter as adapter_mod
from lorafleet.worker.lora.adapter import AdapterError, adapter_digest, load_adapter
from lorafleet.worker.lora.registry import AdapterRegistry
from lorafleet.worker.lora.slots import SLICE_ORDER, LoraSlots, pack_weights

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture
def model(demo_model) -> ModelConfig:
    return ModelConfig.from_folder(demo_model)


def make_registry(model: ModelConfig, dtype: torch.dtype, max_loras: int = 3, max_rank: int = 64) -> AdapterRegistry:
    cfg = EngineConfig(max_loras=max_loras, max_cpu_loras=8, max_lora_rank=max_rank, max_loras_per_request=1)
    slots = LoraSlots(model, max_loras, max_rank, torch.device("cpu"), dtype)
    return AdapterRegistry(model, cfg, slots, dtype)


def write_adapter(folder: Path, model: ModelConfig, dtype: torch.dtype, *, r: int = 8, alpha: float = 24.0,
                  targets=SLICE_ORDER, seed: int = 0, **cfg_extra) -> Path:
    """A PEFT folder with random weights in `dtype` (every layer, the given targets)."""
    g = torch.Generator().manual_seed(seed)
    rank_pattern = cfg_extra.get("rank_pattern", {})
    tensors = {}
    for layer in range(model.num_layers):
        for t in targets:
            out, in_ = model.linear_shape(t)
            rr = rank_pattern.get(t, r)
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[p + ".lora_A.weight"] = (torch.randn(rr, in_, generator=g) * 0.3).to(dtype)
            tensors[p + ".lora_B.weight"] = (torch.randn(out, rr, generator=g) * 0.3).to(dtype)
    folder.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           **cfg_extra}
    (folder / CONFIG).write_text(json.dumps(cfg))
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    return folder


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


# -- one read: the digest ----------------------------------------------------------------------------
def test_digest_is_the_sha256_of_config_and_weights(model, demo_adapters):
    reg = make_registry(model, torch.float32)
    for name, folder in demo_adapters.items():
        raw = (folder / CONFIG).read_bytes() + b"\0" + (folder / WEIGHTS).read_bytes() + b"\0"
        want = "sha256:" + hashlib.sha256(raw).hexdigest()
        assert adapter_digest(folder) == want, name
        assert load_adapter(folder, model, 64, 1 << 30).digest == want, name
        assert reg.read(str(folder)).digest == want, name


def test_read_matches_the_safetensors_library(model, tmp_path):
    """Zero-copy views of the mapped file hold exactly what safetensors loads (two dtypes in one file)."""
    folder = write_adapter(tmp_path / "a", model, torch.bfloat16, r=4)
    tensors = load_file(str(folder / WEIGHTS))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = tensors[key].float()  # a float32 B among bf16 tensors
    save_file(tensors, str(folder / WEIGHTS))
    weights = load_adapter(folder, model, 64, 1 << 30)
    for (layer, target), m in weights.modules.items():
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        p = f"base_model.model.model.layers.{layer}.{block}.{target}"
        assert torch.equal(m.a, tensors[p + ".lora_A.weight"]) and m.a.dtype == tensors[p + ".lora_A.weight"].dtype
        assert torch.equal(m.b, tensors[p + ".lora_B.weight"]) and m.b.dtype == tensors[p + ".lora_B.weight"].dtype


@pytest.mark.parametrize("corrupt", ["empty", "short", "header_past_end", "not_json", "not_object", "gap",
                                     "wrong_size", "trailing_bytes", "truncated", "bad_dtype"])
def test_invalid_safetensors_are_bad_weights(corrupt, model, demo_adapters, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(demo_adapters["sql"], folder)
    path = folder / WEIGHTS
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])

    def with_header(h: dict, body: bytes = data[8 + n :]) -> bytes:
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + body

    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    second = min((k for k in header if k not in ("__metadata__", first)), key=lambda k: header[k]["data_offsets"][0])
    if corrupt == "empty":
        data = b""
    elif corrupt == "short":
        data = data[:5]
    elif corrupt == "header_past_end":
        data = (len(data) * 2).to_bytes(8, "little") + data[8:]
    elif corrupt == "not_json":
        data = (5).to_bytes(8, "little") + b"{oops"
    elif corrupt == "not_object":
        data = with_header([1, 2])  # type: ignore[arg-type]
    elif corrupt == "gap":
        header[second]["data_offsets"][0] += 4
        data = with_header(header)
    elif corrupt == "wrong_size":
        header[first]["shape"][0] += 1
        data = with_header(header)
    elif corrupt == "trailing_bytes":
        data += b"\0" * 16
    elif corrupt == "truncated":
        data = data[:-16]
    elif corrupt == "bad_dtype":
        header[first]["dtype"] = "Q7"
        data = with_header(header)
    path.write_bytes(data)
    with pytest.raises(AdapterError) as info:
        load_adapter(folder, model, 64, 1 << 30)
    assert info.value.reason == "bad_weights", str(info.value)


def test_misaligned_tensor_bytes_are_copied(model):
    base = torch.arange(64, dtype=torch.uint8)
    info = adapter_mod._TensorInfo("x", torch.float32, (2, 3), 2, 26)
    got = adapter_mod._view(base, info)
    assert torch.equal(got, base[2:26].clone().view(torch.float32).view(2, 3))


# -- the packed layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_fill_equals_the_reference_fill(dtype, model, demo_adapters, tmp_path):
    reg = make_registry(model, dtype, max_loras=3, max_rank=64)
    folders = dict(demo_adapters)
    # Same-dtype files (the fast B path), rsLoRA with rank and alpha patterns, a full-rank-64 one.
    folders["native"] = write_adapter(tmp_path / "native", model, dtype, r=8, alpha=20.0)
    folders["patterns"] = write_adapter(tmp_path / "patterns", model, torch.bfloat16, r=16, alpha=7.0, seed=1,
                                        use_rslora=True, rank_pattern={"k_proj": 4, "down_proj": 2},
                                        alpha_pattern={"up_proj": 3.0}, targets=("k_proj", "up_proj", "down_proj"))
    folders["wide"] = write_adapter(tmp_path / "wide", model, torch.float32, r=64, alpha=64.0, seed=2,
                                    targets=("o_proj",))
    for name, folder in folders.items():
        reg.register(name, reg.read(str(folder)))
    # The slots get reused: each adapter lands on a slot that held another one (ranks must follow).
    for name, folder in folders.items():
        slot = reg.activate([name], {name})[name]
        want = reference_slot(load_adapter(folder, model, 64, 1 << 30), model, dtype)
        assert_slot_equals(reg.slots, slot, want)
        assert reg.slots.slot_max_rank[slot] == max(r for r, _, _ in want.values())


def test_packed_layout_is_slot_order_and_flat(model, demo_adapters):
    weights = load_adapter(demo_adapters["chat"], model, 64, 1 << 30)
    one = pack_weights(weights, model.num_layers, torch.float32, pin=False)
    assert len(one.chunks) == 1  # unpinned: one flat buffer
    block_bytes = max(a.numel() + b.numel() for _, _, a, b in one.blocks) * 4
    many = pack_weights(weights, model.num_layers, torch.float32, pin=False, chunk_bytes=3 * block_bytes)
    assert len(many.chunks) > 1
    for packed in (one, many):
        ks = [k for k, _, _, _ in packed.blocks]
        assert ks == sorted(ks) and len(ks) == len(weights.modules)
        assert sum(c.numel() for c in packed.chunks) == sum(a.numel() + b.numel() for _, _, a, b in packed.blocks)
        assert all(c.numel() * 4 <= 3 * block_bytes for c in many.chunks)
        ptrs = {c.untyped_storage().data_ptr() for c in packed.chunks}
        for k, r, a, b in packed.blocks:
            layer, target = k // len(SLICE_ORDER), SLICE_ORDER[k % len(SLICE_ORDER)]
            m = weights.modules[(layer, target)]
            assert a.is_contiguous() and b.is_contiguous() and a.untyped_storage().data_ptr() in ptrs
            # B is rank-major in the buffer, scaled; A rows as they are.
            assert torch.equal(a.view(r, -1), m.a)
            assert torch.equal(b.view(r, -1), (m.b.float() * m.scaling).T)
            assert int(packed.ranks[layer, k % len(SLICE_ORDER)]) == r
        assert int(packed.ranks.count_nonzero()) == len(weights.modules)


def test_cpu_cache_keeps_only_the_packed_copy(model, demo_adapters):
    reg = make_registry(model, torch.bfloat16)
    weights = reg.read(str(demo_adapters["code"]))  # rsLoRA: scaling != 1
    raw = {k: (m.a.clone(), m.b.clone(), m.scaling) for k, m in weights.modules.items()}
    assert all(m.scaling != 1.0 for m in weights.modules.values())  # read leaves the modules as in the file
    reg.register("code", weights)
    ptrs = {c.untyped_storage().data_ptr() for c in weights.packed.chunks}
    for key, m in weights.modules.items():
        a, b, scaling = raw[key]
        assert m.scaling == 1.0
        assert m.a.untyped_storage().data_ptr() in ptrs and m.b.untyped_storage().data_ptr() in ptrs
        assert torch.equal(m.a, a.to(torch.bfloat16))
        assert torch.equal(m.b, (b.float() * scaling).to(torch.bfloat16))
    assert weights.nbytes == weights.packed.nbytes


def test_fill_packs_weights_made_elsewhere(model, demo_adapters):
    """LoraSlots.fill still takes plain LoraWeights (benchmarks build them in memory)."""
    slots = LoraSlots(model, 2, 64, torch.device("cpu"), torch.float32)
    weights = load_adapter(demo_adapters["legal"], model, 64, 1 << 30)
    slots.fill(1, weights)
    assert_slot_equals(slots, 1, reference_slot(weights, model, torch.float32))
    assert slots.rank_bound(torch.tensor([[1], [-1]], dtype=torch.int32)) == 8
    assert slots.rank_bound(torch.tensor([[0], [-1]], dtype=torch.int32)) == 0
    slots.clear(1)
    assert slots.rank_bound(torch.tensor([[1]], dtype=torch.int32)) == 0
    assert int(slots.ranks_device[:, :, 1].abs().sum()) == 0


# -- NaN / Inf ------------------------------------------------------------------------------------------
def poison(folder: Path, needle: str, value: float, layer: int = 1) -> None:
    path = folder / WEIGHTS
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if needle in k and f"layers.{layer}." in k)
    tensors[key].view(-1)[-1] = value
    save_file(tensors, str(path))


@pytest.mark.parametrize("needle, value", [("lora_A", math.nan), ("lora_B", math.inf), ("lora_B", -math.inf)])
def test_non_finite_weights_are_refused(needle, value, model, demo_adapters, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(demo_adapters["chat"], folder)
    poison(folder, needle, value)
    reg = make_registry(model, torch.bfloat16)
    with pytest.raises(AdapterError, match=r"layer 1 \w+_proj: weights contain NaN or Inf") as info:
        reg.read(str(folder))
    assert info.value.reason == "bad_weights"
    with pytest.raises(AdapterError) as info:  # without the registry: checked on the file's own bytes
        load_adapter(folder, model, 64, 1 << 30)
    assert info.value.reason == "bad_weights"


def test_overflow_in_the_slot_dtype_is_refused(model, demo_adapters, tmp_path):
    """Finite in the file, Inf once scaled and rounded to fp16: never reaches a slot."""
    folder = tmp_path / "big"
    shutil.copytree(demo_adapters["chat"], folder)
    poison(folder, "lora_B", 1e5)
    assert load_adapter(folder, model, 64, 1 << 30).modules  # fp32 in the file: fine as it is
    with pytest.raises(AdapterError, match="overflow") as info:
        make_registry(model, torch.float16).read(str(folder))
    assert info.value.reason == "bad_weights"
    make_registry(model, torch.float32).read(str(folder))  # fp32 slots hold it


def test_all_finite_finds_one_bad_value_anywhere():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1 << 20).to(dtype)
        assert adapter_mod.all_finite(x)
        for pos in (0, 12345, (1 << 20) - 1):
            for bad in (math.nan, math.inf, -math.inf):
                y = x.clone()
                y[pos] = bad
                assert not adapter_mod.all_finite(y), (dtype, pos, bad)


# -- CUDA: pinned layout, side-stream fill, the check on the GPU --------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_cuda_registry(model: ModelConfig, dtype: torch.dtype, max_loras: int = 2) -> AdapterRegistry:
    cfg = EngineConfig(max_loras=max_loras, max_cpu_loras=8, max_lora_rank=64, max_loras_per_request=1,
                       device="cuda")
    slots = LoraSlots(model, max_loras, 64, torch.device("cuda"), dtype)
    return AdapterRegistry(model, cfg, slots, dtype)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fill_from_pinned_layout_equals_the_reference(dtype, model, demo_adapters):
    reg = make_cuda_registry(model, dtype, max_loras=2)
    for name, folder in demo_adapters.items():
        weights = reg.read(str(folder))
        assert weights.packed.pinned and all(c.is_pinned() for c in weights.packed.chunks)
        assert weights.packed.ranks.is_pinned()
        reg.register(name, weights)
        assert all(m.a.is_pinned() and m.b.is_pinned() for m in weights.modules.values())
    for name, folder in demo_adapters.items():  # 5 adapters through 2 slots: every fill overwrites one
        reg.prefetch([name], protected=set())
        slot = reg.activate([name], {name})[name]  # waits on the side stream's event
        torch.cuda.current_stream().synchronize()
        assert_slot_equals(reg.slots, slot, reference_slot(load_adapter(folder, model, 64, 1 << 30), model, dtype))


@pytest.mark.gpu
@cuda
def test_cuda_non_finite_refused_by_the_gpu_check(model, demo_adapters, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(demo_adapters["chat"], folder)
    poison(folder, "lora_B", math.nan)
    reg = make_cuda_registry(model, torch.bfloat16)
    with pytest.raises(AdapterError, match=r"layer 1 \w+_proj: weights contain NaN or Inf") as info:
        reg.read(str(folder))
    assert info.value.reason == "bad_weights"
    big = tmp_path / "big"
    shutil.copytree(demo_adapters["chat"], big)
    poison(big, "lora_B", 1e5)
    with pytest.raises(AdapterError, match="overflow"):
        make_cuda_registry(model, torch.float16).read(str(big))
    assert reg.read(str(demo_adapters["chat"])).packed is not None  # the same registry still reads good ones

"""Reading an adapter for the registry (`AdapterReader`, through `AdapterRegistry.read`): weights
with NaN/Inf, or that overflow the slot dtype once scaled, are refused; with slots on a GPU the
file is laid out and checked there, on the reader's stream, and comes back bit for bit as the host
lays it out."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.config import ModelConfig
from lorafleet.worker.lora import adapter as adapter_mod
from lorafleet.worker.lora import packing
from lorafleet.worker.lora.adapter import AdapterError, ModuleWeights, adapter_digest, load_adapter
from lorafleet.worker.lora.packing import pack_weights
from tests.worker.lora_harness import (
    WEIGHTS,
    bits,
    cuda,
    layout_folders,
    make_cuda_registry,
    make_registry,
    random_weights,
    write_adapter,
)


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


def test_all_finite_takes_float8():
    x = torch.zeros(8, dtype=torch.float8_e4m3fn)
    assert adapter_mod.all_finite(x)
    x.view(torch.uint8)[3] = 0x7F  # NaN in e4m3fn
    assert not adapter_mod.all_finite(x)


def test_all_finite_finds_one_bad_value_anywhere():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1 << 20).to(dtype)
        assert adapter_mod.all_finite(x)
        for pos in (0, 12345, (1 << 20) - 1):
            for bad in (math.nan, math.inf, -math.inf):
                y = x.clone()
                y[pos] = bad
                assert not adapter_mod.all_finite(y), (dtype, pos, bad)


# -- CUDA ------------------------------------------------------------------------------------------------

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


def misaligned(folder: Path) -> Path:
    """Pad the header so that the data section, and so every tensor, starts at an odd offset."""
    path = folder / WEIGHTS
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].rstrip()
    header += b" " * (1 - len(header) % 2)  # 8 + odd = odd
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])
    return folder


def gpu_read_folders(model: ModelConfig, demo_adapters, tmp_path: Path, dtype: torch.dtype) -> dict[str, Path]:
    """`layout_folders`, plus fp64 and fp8 files and one whose tensors all start at odd offsets."""
    folders = layout_folders(model, demo_adapters, tmp_path, dtype)
    folders["fp64"] = write_adapter(tmp_path / "fp64", model, torch.float64, r=4, seed=4)
    folders["fp8"] = write_adapter(tmp_path / "fp8", model, torch.float8_e4m3fn, r=4, seed=5)
    folders["misaligned"] = misaligned(write_adapter(tmp_path / "odd", model, torch.bfloat16, r=4, seed=6))
    return folders


# Per folder: whether the one-launch layout applies (a single buffer of float16/bfloat16/float32).
ONE_LAUNCH = {"fp64": False, "fp8": False, "misaligned": False}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["planned while read", "planned after read", "no room for the file",
                                  "no room for the layout"])
def test_cuda_read_lays_out_on_the_gpu_what_the_host_lays_out(dtype, mode, model, demo_adapters, tmp_path,
                                                              monkeypatch):
    """With slots on a GPU the file goes there as it is read (in small chunks here, cut inside
    tensors) and is laid out there: the pinned layout it comes back in is bit for bit what the host
    lays out from the same file (same-dtype and converted files, fp64 and fp8 files, rsLoRA, rank
    and alpha patterns, tensors at odd offsets). Planned after the read, or without room on the GPU
    for the file (laid out on the host) or for its layout (copied to the host one by one): the same."""
    monkeypatch.setattr(adapter_mod, "UPLOAD_CHUNK_BYTES", 4096)
    real_init = adapter_mod._Upload.__init__

    def init(self, device, size):
        real_init(self, device, size)
        if mode == "no room for the file":
            self.raw = None
        else:  # bytes not yet uploaded read as NaN: a read too early fails the check
            self.raw.fill_(0xFF)

    monkeypatch.setattr(adapter_mod._Upload, "__init__", init)
    monkeypatch.setattr(adapter_mod, "PLAN_WHILE_READING", mode != "planned after read")
    if mode == "no room for the layout":
        monkeypatch.setattr(packing, "_device_buffer", lambda *a: None)
    launched = []
    real_launches = packing._launches
    monkeypatch.setattr(packing, "_launches", lambda *a: launched.append(real_launches(*a)) or launched[-1])
    reg = make_cuda_registry(model, dtype)
    for name, folder in gpu_read_folders(model, demo_adapters, tmp_path, dtype).items():
        launched.clear()
        weights = reg.read(str(folder))
        one_launch = mode in ("planned while read", "planned after read") and ONE_LAUNCH.get(name, True)
        assert (len(launched) == 1 and len(launched[0]) == 1) == one_launch, name
        want = pack_weights(load_adapter(folder, model, 64, 1 << 30), model.num_layers, dtype, pin=False)
        got = weights.packed
        got.wait_host()
        assert got.pinned and all(c.is_pinned() for c in got.chunks), name
        assert got.layout == want.layout and torch.equal(got.ranks, want.ranks), name
        assert torch.equal(bits(torch.cat(got.chunks)), bits(torch.cat(want.chunks))), name
        if mode != "no room for the file":  # the modules are views of the pinned layout: the file's GPU copy is gone
            assert all(m.a.is_pinned() and m.b.is_pinned() for m in weights.modules.values()), name
        assert weights.digest.value == adapter_digest(folder), name
    # Weights made on the GPU tensor by tensor (no one buffer): the per-copy path, same result.
    made = random_weights(model, 8, torch.float32, seed=3)
    on_gpu = dataclasses.replace(made, modules={k: ModuleWeights(a=m.a.cuda(), b=m.b.cuda(), scaling=m.scaling)
                                                 for k, m in made.modules.items()})
    want = pack_weights(made, model.num_layers, dtype, pin=False)
    got = pack_weights(on_gpu, model.num_layers, dtype, pin=True)
    assert torch.equal(bits(torch.cat(got.chunks)), bits(torch.cat(want.chunks)))


@pytest.mark.gpu
@cuda
def test_cuda_reads_at_once_share_the_registrys_stream(model, demo_adapters, tmp_path):
    """Reads in several threads (as the admin endpoint and re-reads run them) through one registry
    and its one side stream each get their own adapter's layout."""
    from concurrent.futures import ThreadPoolExecutor

    folders = gpu_read_folders(model, demo_adapters, tmp_path, torch.bfloat16)
    reg = make_cuda_registry(model, torch.bfloat16)
    with ThreadPoolExecutor(8) as pool:
        got = dict(zip(folders, pool.map(lambda f: reg.read(str(f)), [*folders.values()] * 2)))
    for name, folder in folders.items():
        want = pack_weights(load_adapter(folder, model, 64, 1 << 30), model.num_layers, torch.bfloat16, pin=False)
        got[name].packed.wait_host()
        assert torch.equal(bits(torch.cat(got[name].packed.chunks)), bits(torch.cat(want.chunks))), name


@pytest.mark.gpu
@cuda
def test_cuda_fp8_overflow_is_a_clear_error(model, tmp_path):
    """fp8 weights that overflow the slot dtype once scaled: refused with the module named (the
    check upcasts fp8, which has no isfinite kernel)."""
    folder = write_adapter(tmp_path / "fp8", model, torch.float8_e4m3fn, r=4, alpha=4e6, seed=7)
    with pytest.raises(AdapterError, match="overflow") as info:
        make_cuda_registry(model, torch.float16).read(str(folder))
    assert info.value.reason == "bad_weights"


@pytest.mark.gpu
@cuda
def test_cuda_read_plans_the_layout_while_the_file_is_still_being_read(model, tmp_path, monkeypatch):
    """Only the header's piece may land before the layout is planned: the rest of the file is held
    back until `plan_pack` has run (or 20 s). The plan waits for no byte it does not need; the
    result is still the host's layout, bit for bit."""
    import threading

    from lorafleet.worker.lora import file_bytes
    from lorafleet.worker.lora import reader as reader_mod

    planned, held_back = threading.Event(), []
    real_piece, real_plan = file_bytes._read_piece, reader_mod.plan_pack

    def piece(fd, view, offset, path):
        if offset:
            held_back.append(not planned.wait(20))
        real_piece(fd, view, offset, path)

    def plan(*args, **kwargs):
        planned.set()
        return real_plan(*args, **kwargs)

    folder = write_adapter(tmp_path / "a", model, torch.float32, r=32)
    data = (folder / WEIGHTS).read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    monkeypatch.setattr(file_bytes, "PIECE_BYTES", header)  # the first piece holds the header, and no more
    assert len(data) > 3 * header
    monkeypatch.setattr(file_bytes, "_read_piece", piece)
    monkeypatch.setattr(reader_mod, "plan_pack", plan)
    weights = make_cuda_registry(model, torch.bfloat16).read(str(folder))
    assert held_back and not any(held_back)  # every later piece was released by the plan, none by the timeout
    want = pack_weights(load_adapter(folder, model, 64, 1 << 30), model.num_layers, torch.bfloat16, pin=False)
    weights.packed.wait_host()
    assert torch.equal(bits(torch.cat(weights.packed.chunks)), bits(torch.cat(want.chunks)))

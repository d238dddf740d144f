"""The adapter load path: one read (digest + parse), the packed slot layout, and the NaN/Inf check.

The slot contents a packed fill produces are compared, bit for bit, with a straightforward
reference: the per-tensor preparation and fill the registry used before the packed layout
(scale B in float32, round to the slot dtype, copy A rows and B^T into the slot), done module by
module into separately allocated per-layer stacks (`ReferencePool`), for whole stacks, stale rows
included. A fill's copies are counted: one per piece (a run of layers of one column at one rank),
not one per layer and module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from lorafleet.kernels.lora_ops import lora_b_layout, new_lora_b
from lorafleet.worker.config import FUSED_SLICES, EngineConfig, ModelConfig
from lorafleet.worker.lora import adapter as adapter_mod
from lorafleet.worker.lora import packing
from lorafleet.worker.lora import slots as slots_mod
from lorafleet.worker.lora.adapter import (
    AdapterError,
    LoraWeights,
    ModuleWeights,
    adapter_digest,
    load_adapter,
)
from lorafleet.worker.lora.packing import SLICE_ORDER, pack_weights
from lorafleet.worker.lora.registry import AdapterRegistry
from lorafleet.worker.lora.slots import LoraSlots

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
            rr = adapter_mod._pattern_value(rank_pattern, f"model.layers.{layer}.{block}.{t}", r)
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
        assert load_adapter(folder, model, 64, 1 << 30).digest.value == want, name
        assert reg.read(str(folder)).digest.value == want, name


def test_digest_reused_for_unchanged_files_and_recomputed_after_a_change(tmp_path, model, demo_adapters, monkeypatch):
    """A second read of the same unchanged folder skips sha256; rewriting the weights (even with
    the same size and the old mtime put back) changes the ctime, so the new content is hashed."""
    import os
    import shutil

    from lorafleet.worker.lora import adapter as adapter_mod

    folder = tmp_path / "a"
    shutil.copytree(next(iter(demo_adapters.values())), folder)
    hashed = []
    real = adapter_mod.Sha256Thread
    monkeypatch.setattr(adapter_mod, "Sha256Thread", lambda parts, **kw: hashed.append(1) or real(parts, **kw))
    first = adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    first.digest.value  # noqa: B018 - the hash is complete (and cached) before the second read
    second = adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    assert len(hashed) == 1 and second.digest.value == first.digest.value == adapter_mod.adapter_digest(folder)

    weights = folder / adapter_mod.WEIGHTS_FILE
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size: flip a bit in the last tensor's bytes
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back; ctime moves on
    third = adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    assert len(hashed) == 2 and third.digest.value == adapter_mod.adapter_digest(folder) != first.digest.value


def test_a_folder_removed_after_its_read_keeps_its_digest_out_of_the_cache(tmp_path, model, demo_adapters,
                                                                         monkeypatch, caplog):
    """An operator may delete a folder once it is loaded: the hash still completes (over the mapped
    bytes) with the right value, nothing is logged as an error and nothing is cached for the path."""
    from lorafleet.worker.lora.digest import Sha256Thread

    held = []

    class Deferred:  # runs the hash when the test says so, after the folder is gone
        def __init__(self, parts, on_done=None):
            held.append((parts, on_done))

    monkeypatch.setattr(adapter_mod, "DIGEST_CACHE", type(adapter_mod.DIGEST_CACHE)())
    folder = tmp_path / "a"
    shutil.copytree(next(iter(demo_adapters.values())), folder)
    want = adapter_digest(folder)
    monkeypatch.setattr(adapter_mod, "Sha256Thread", Deferred)
    adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    shutil.rmtree(folder)
    (parts, on_done), = held
    with caplog.at_level("ERROR"):
        assert "sha256:" + Sha256Thread(parts, on_done=on_done).hexdigest() == want  # joins: on_done has run
    assert not caplog.records and not adapter_mod.DIGEST_CACHE._items


def test_a_digest_under_way_at_exit_completes_first(tmp_path):
    """A process that exits while an adapter's sha256 is still running waits for it (its `on_done`
    runs) instead of finalizing the interpreter under the thread (pytorch/pytorch#38228: a daemon
    thread ended inside a C++ frame aborts the process)."""
    import subprocess
    import sys

    out = tmp_path / "done"
    script = (
        "import time\n"
        "from lorafleet.worker.lora.digest import Sha256Thread\n"
        "def done(h):\n"
        "    time.sleep(0.2)\n"
        f"    open({str(out)!r}, 'w').write(h)\n"
        "Sha256Thread([bytes(1 << 24)] * 8, on_done=done)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=tmp_path)
    want = hashlib.sha256()
    for _ in range(8):
        want.update(bytes(1 << 24))
    assert out.read_text() == want.hexdigest()


def test_a_load_does_not_wait_for_its_digest(tmp_path, demo_model, demo_adapters, monkeypatch):
    """The adapter serves while its sha256 is still running (the hash is held back here); what
    needs the value (a second load under the same name) gets the right one once it is done."""
    import threading

    from lorafleet.worker.engine import LLMEngine
    from lorafleet.worker.lora.registry import AdapterConflict
    from lorafleet.worker.sequence import SamplingParams

    gate = threading.Event()
    real = adapter_mod.Sha256Thread

    class HeldBack(real):
        def _run(self, parts):
            gate.wait(60)
            super()._run(parts)

    monkeypatch.setattr(adapter_mod, "Sha256Thread", HeldBack)
    monkeypatch.setattr(adapter_mod, "DIGEST_CACHE", type(adapter_mod.DIGEST_CACHE)())  # no earlier digests
    names = list(demo_adapters)
    a, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(demo_adapters[names[0]], a)
    shutil.copytree(demo_adapters[names[1]], other)
    engine = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=4, num_kv_blocks=64))
    served = []
    worker = threading.Thread(target=lambda: served.append(
        (engine.load_adapter("a", str(a)),
         engine.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), [(("a", 1.0),)]))))
    worker.start()
    worker.join(60)
    assert served and served[0][0] is True and len(served[0][1][0].token_ids) == 3  # loaded and served ...
    entry = engine.registry.entries["a"]
    assert not entry.digest.ready  # ... with the hash still held back
    gate.set()
    assert entry.digest.value == adapter_digest(a)
    assert engine.load_adapter("a", str(a)) is False  # same content: a no-op
    with pytest.raises(AdapterConflict):
        engine.load_adapter("a", str(other))


def test_read_matches_the_safetensors_library(model, tmp_path):
    """Zero-copy views of the bytes read hold exactly what safetensors loads (two dtypes in one file)."""
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
    info = adapter_mod.TensorInfo("x", torch.float32, (2, 3), 2, 26)
    got = adapter_mod.tensor_view(base, info)
    assert torch.equal(got, base[2:26].clone().view(torch.float32).view(2, 3))


def test_typed_views_equal_plain_views():
    """Views through the per-dtype cache hold the tensor's bytes, as a copy of them reinterpreted would."""
    base = torch.arange(200, dtype=torch.uint8)
    typed: dict = {}
    infos = [adapter_mod.TensorInfo("a", torch.float32, (2, 3), 8, 32), adapter_mod.TensorInfo("b", torch.bfloat16, (3, 2, 2), 34, 58),
             adapter_mod.TensorInfo("c", torch.float16, (0, 4), 60, 60), adapter_mod.TensorInfo("d", torch.float32, (5,), 61, 81)]
    for info in infos:
        got = adapter_mod.tensor_view(base, info, typed)
        want = base[info.begin : info.end].clone().view(info.dtype).view(info.shape)
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want), info.name
        if info.begin % info.dtype.itemsize == 0:
            assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # a view, not a copy


# -- the packed layout ---------------------------------------------------------------------------------
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_fill_equals_the_reference_fill(dtype, model, demo_adapters, tmp_path):
    reg = make_registry(model, dtype, max_loras=3, max_rank=64)
    folders = layout_folders(model, demo_adapters, tmp_path, dtype)
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


def test_packing_on_the_host_walks_the_file_in_order(model, demo_adapters, monkeypatch):
    """On the host pack_weights copies modules in the order their bytes lie in the file, not in slot
    order, so the copies walk the bytes read front to back; the packed result is the same (test above)."""
    weights = load_adapter(demo_adapters["chat"], model, 64, 1 << 30)
    offsets = []
    real = packing._pack_rows
    monkeypatch.setattr(packing, "_pack_rows", lambda m, half, *rest: (
        offsets.append((m.a if half == packing._A else m.b).data_ptr()), real(m, half, *rest))[-1])
    pack_weights(weights, model.num_layers, torch.float32, pin=False)
    assert len(offsets) == 2 * len(weights.modules)
    assert offsets == sorted(offsets)
    # ...which is not the slot order: that goes column by column over all layers, the file layer by layer
    placement = [(k, half) for half in (0, 1)
                 for k in sorted(weights.modules, key=lambda k: (SLICE_ORDER.index(k[1]), k[0]))]
    by_placement = [(weights.modules[k].a if half == 0 else weights.modules[k].b).data_ptr() for k, half in placement]
    assert by_placement != sorted(by_placement)


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


# -- one copy per piece: all layers' stacks in one tensor per column ------------------------------------
def deep(model: ModelConfig, layers: int = 6) -> ModelConfig:
    """The demo model's shapes with more layers (runs of layers are what the packed layout groups)."""
    return dataclasses.replace(model, num_layers=layers)


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


class ReferencePool:
    """Per-layer stacks allocated one by one (torch.zeros for A, `new_lora_b` for B), as the pool
    was before its storage was shared across layers, filled module by module from `reference_slot`."""

    def __init__(self, model: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        self.a, self.b, self.ranks = {}, {}, {}
        for layer in range(model.num_layers):
            for fused in FUSED_SLICES:
                for j, (in_, out) in enumerate(model.slice_sizes(fused)):
                    key = (layer, fused, j)
                    self.a[key] = torch.zeros(num_slots, max_rank, in_, dtype=dtype)
                    self.b[key] = new_lora_b(num_slots, out, max_rank, device="cpu", dtype=dtype)
                    self.ranks[key] = [0] * num_slots

    def fill(self, slot: int, want) -> None:
        for key, (r, a, b) in want.items():
            self.ranks[key][slot] = r
            if r:
                self.a[key][slot, :r].copy_(a)
                self.b[key][slot, :, :r].copy_(b)


def assert_pool_equals(slots: LoraSlots, ref: ReferencePool) -> None:
    """Every stack, bit for bit (stale rows too), with the reference's shapes, strides and ranks."""
    for key, a in ref.a.items():
        layer, fused, j = key
        s, b = slots.layers[layer][fused], ref.b[key]
        got_a, got_b = s.lora_a[j].cpu(), s.lora_b[j].cpu()
        assert got_a.shape == a.shape and got_a.stride() == a.stride(), key
        assert got_b.shape == b.shape and got_b.stride() == b.stride(), key
        assert torch.equal(bits(got_a), bits(a)), key
        assert torch.equal(bits(got_b), bits(b)), key
        assert s.ranks[j] == ref.ranks[key], key
        assert s.ranks_device[j].tolist() == ref.ranks[key], key


class CountCopies(TorchDispatchMode):
    """Counts tensor copies as the dispatcher sees them (a `_foreach_copy_` counts its list)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("copy_", "_copy_from", "_to_copy"):
            self.copies += 1
        elif name.startswith("_foreach_copy"):
            self.copies += len(args[0])
        return func(*args, **(kwargs or {}))


def fill_copies(slots: LoraSlots, slot: int, weights: LoraWeights) -> int:
    with CountCopies() as counter:
        slots.fill(slot, weights)
    return counter.copies


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


def test_slot_views_keep_the_kernel_layout(model):
    """Each layer's stacks are views of one [L, S, r_max, in|out] tensor per column, with exactly the
    shapes and strides per-layer tensors had (A contiguous, B rank-major as new_lora_b makes it)."""
    m = deep(model, 3)
    slots = LoraSlots(m, 3, 16, torch.device("cpu"), torch.bfloat16)
    ref = ReferencePool(m, 3, 16, torch.bfloat16)
    assert slots.nbytes() == sum(t.numel() * t.element_size() for d in (ref.a, ref.b) for t in d.values())
    for (layer, fused, j), a in ref.a.items():
        s = slots.layers[layer][fused]
        assert s.lora_a[j].is_contiguous() and s.lora_a[j].stride() == a.stride()
        assert lora_b_layout(s.lora_b[j]) == "rank_major" and s.lora_b[j].stride() == ref.b[(layer, fused, j)].stride()
        base = slots.layers[0][fused]
        assert s.lora_a[j].untyped_storage().data_ptr() == base.lora_a[j].untyped_storage().data_ptr()
        assert s.lora_a[j].data_ptr() - base.lora_a[j].data_ptr() == layer * a.numel() * a.element_size()
        assert s.lora_b[j].untyped_storage().data_ptr() == base.lora_b[j].untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_equals_the_reference_pool(dtype, model, tmp_path):
    """Uniform ranks, per-layer rank patterns, subsets of targets and layers, through 2 reused slots."""
    m = deep(model, 6)
    reg = make_registry(m, dtype, max_loras=2, max_rank=32)
    folders = {
        "uniform": write_adapter(tmp_path / "uniform", m, dtype, r=8, alpha=16.0),
        "big": write_adapter(tmp_path / "big", m, torch.float32, r=32, alpha=8.0, seed=1),
        "layer_pattern": write_adapter(
            tmp_path / "layer_pattern", m, torch.bfloat16, r=8, alpha=16.0, seed=2,
            rank_pattern={"layers.2.self_attn.q_proj": 4, "model.layers.3.mlp.down_proj": 16, "k_proj": 2},
            alpha_pattern={"layers.4.mlp.up_proj": 3.0}),
        "subset": write_adapter(tmp_path / "subset", m, dtype, r=4, alpha=4.0, seed=3, layers=(0, 2, 3, 5),
                                targets=("v_proj", "gate_proj")),
        "small": write_adapter(tmp_path / "small", m, dtype, r=2, alpha=4.0, seed=4, use_rslora=True),
    }
    for name, folder in folders.items():
        reg.register(name, reg.read(str(folder)))
    ref = ReferencePool(m, 2, 32, dtype)
    # LRU reuse: big (rank 32) lands where uniform was, small (rank 2) where layer_pattern was, subset
    # (rank 4, 4 of 6 layers) where big was, and uniform again where small was.
    for name in ("uniform", "layer_pattern", "big", "small", "subset", "uniform"):
        slot = reg.activate([name], {name})[name]
        want = reference_slot(load_adapter(folders[name], m, 32, 1 << 30), m, dtype)
        ref.fill(slot, want)
        assert_pool_equals(reg.slots, ref)
        assert reg.slots.slot_max_rank[slot] == max(r for r, _, _ in want.values())
    packed = reg.cpu["layer_pattern"].packed
    # Column runs: q breaks at layer 2 (rank 4), down at layer 3 (rank 16); k is rank 2 everywhere.
    assert [p for p in packed.layout if p[0] == SLICE_ORDER.index("q_proj")] == [
        (0, 0, 0, 2, 8), (0, 0, 2, 1, 4), (0, 0, 3, 3, 8), (0, 1, 0, 2, 8), (0, 1, 2, 1, 4), (0, 1, 3, 3, 8)]
    assert [p for p in reg.cpu["subset"].packed.layout if p[1] == 0] == [
        (2, 0, 0, 1, 4), (2, 0, 2, 2, 4), (2, 0, 5, 1, 4), (4, 0, 0, 1, 4), (4, 0, 2, 2, 4), (4, 0, 5, 1, 4)]


@pytest.mark.parametrize("layers", [2, 4, 8])
def test_copies_per_fill_do_not_grow_with_layers(layers, model):
    """A uniform adapter on all 7 targets: 14 pieces (A and B per column) + the rank table, for any
    number of layers (was 2 x 7 x layers + 1); a buffer cut inside a piece adds one."""
    m = deep(model, layers)
    slots = LoraSlots(m, 2, 16, torch.device("cpu"), torch.bfloat16)
    weights = random_weights(m, 8)
    weights.packed = slots.pack(weights)
    assert fill_copies(slots, 0, weights) == 2 * len(SLICE_ORDER) + 1
    ref = ReferencePool(m, 2, 16, torch.bfloat16)
    ref.fill(0, reference_slot(weights, m, torch.bfloat16))
    assert_pool_equals(slots, ref)
    # Buffers of 4 layers' rows of the largest piece: cuts fall at layers, each adds at most one copy.
    per_layer = 8 * max(max(io) for f in FUSED_SLICES for io in m.slice_sizes(f)) * 2
    weights.packed = pack_weights(weights, layers, torch.bfloat16, pin=False, chunk_bytes=4 * per_layer)
    cuts = len(weights.packed.chunks) - 1
    assert all(c.numel() * 2 <= 4 * per_layer for c in weights.packed.chunks)
    assert len(weights.packed.sources) <= 2 * len(SLICE_ORDER) + cuts
    assert fill_copies(slots, 1, weights) == len(weights.packed.sources) + 1
    assert sum(c.numel() for c in weights.packed.chunks) == sum(s.numel() for s in weights.packed.sources)
    ref.fill(1, reference_slot(weights, m, torch.bfloat16))
    assert_pool_equals(slots, ref)


def test_copies_follow_rank_runs(model):
    """Ranks that change along the layers split a column into runs: one copy per run and half."""
    m = deep(model, 8)
    slots = LoraSlots(m, 1, 16, torch.device("cpu"), torch.float32)
    weights = random_weights(m, 8, torch.float32, ranks=lambda layer, t: 4 if t == "o_proj" and layer in (3, 4) else 8)
    weights.packed = slots.pack(weights)
    assert fill_copies(slots, 0, weights) == 2 * (len(SLICE_ORDER) + 2) + 1  # o_proj: layers 0-2, 3-4, 5-7
    ref = ReferencePool(m, 1, 16, torch.float32)
    ref.fill(0, reference_slot(weights, m, torch.float32))
    assert_pool_equals(slots, ref)


def test_fill_without_room_to_stage_goes_layer_by_layer(model, monkeypatch):
    """An OOM staging a strided piece: the same pieces again, one contiguous layer at a time."""
    m = deep(model, 4)
    slots = LoraSlots(m, 2, 16, torch.device("cpu"), torch.bfloat16)
    weights = random_weights(m, 8)
    calls = []
    real = slots_mod._copy_all

    def flaky(dst, src):
        calls.append(len(dst))
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("no room for a temporary")
        assert all(d.is_contiguous() for d in dst)
        real(dst, src)

    monkeypatch.setattr(slots_mod, "_copy_all", flaky)
    slots.fill(1, weights)
    assert calls == [2 * len(SLICE_ORDER), 2 * len(SLICE_ORDER) * m.num_layers]
    ref = ReferencePool(m, 2, 16, torch.bfloat16)
    ref.fill(1, reference_slot(weights, m, torch.bfloat16))
    assert_pool_equals(slots, ref)


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


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_strided_piece_copies_equal_the_reference_pool(dtype, model):
    """Pinned pieces into strided [layers, rank, dim] slot views (PyTorch stages them on the side
    stream), buffers cut inside pieces, a rank run, and a smaller adapter over a larger one."""
    m = deep(model, 6)
    slots = LoraSlots(m, 2, 16, torch.device("cuda"), dtype)
    ref = ReferencePool(m, 2, 16, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    per_layer = 8 * max(max(io) for f in FUSED_SLICES for io in m.slice_sizes(f)) * size
    cases = [(0, 8, 3 * per_layer, lambda layer, t: 4 if (layer, t) == (2, "q_proj") else 8),
             (1, 16, None, None), (1, 2, None, None)]
    for seed, (slot, r, chunk_bytes, ranks) in enumerate(cases):
        weights = random_weights(m, r, dtype, ranks=ranks, seed=seed)
        weights.packed = pack_weights(weights, m.num_layers, dtype, pin=True, chunk_bytes=chunk_bytes)
        assert all(c.is_pinned() for c in weights.packed.chunks)
        assert fill_copies(slots, slot, weights) == len(weights.packed.sources) + 1
        slots.wait([slot])
        torch.cuda.synchronize()
        ref.fill(slot, reference_slot(weights, m, dtype))
        assert_pool_equals(slots, ref)


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
    from lorafleet.worker.lora import registry as registry_mod

    planned, held_back = threading.Event(), []
    real_piece, real_plan = file_bytes._read_piece, registry_mod.plan_pack

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
    monkeypatch.setattr(registry_mod, "plan_pack", plan)
    weights = make_cuda_registry(model, torch.bfloat16).read(str(folder))
    assert held_back and not any(held_back)  # every later piece was released by the plan, none by the timeout
    want = pack_weights(load_adapter(folder, model, 64, 1 << 30), model.num_layers, torch.bfloat16, pin=False)
    weights.packed.wait_host()
    assert torch.equal(bits(torch.cat(weights.packed.chunks)), bits(torch.cat(want.chunks)))


@pytest.mark.gpu
@cuda
def test_cuda_a_load_waits_for_the_check_not_for_the_copy_back(model, demo_adapters, monkeypatch):
    """The layout's copy back into pinned memory is held back here (the registry's stream sleeps
    ~0.1 s before it). `read` returns with it still queued; the fill takes the GPU copy, and the
    compute stream passes it with the copy back still queued. An adapter whose GPU copy was let
    go fills from the pinned buffers, waiting for the copy back on the GPU: both slots equal the
    reference, and the host buffers after `wait_host` equal the host's own layout."""
    real = packing.PackPlan.copy_back

    def late(self):
        torch.cuda._sleep(200_000_000)
        real(self)

    monkeypatch.setattr(packing.PackPlan, "copy_back", late)
    reg = make_cuda_registry(model, torch.bfloat16, max_loras=2)
    for name, keep_gpu_copy in (("chat", True), ("sql", False)):
        folder = demo_adapters[name]
        weights = reg.read(str(folder))
        packed = weights.packed
        assert packed.gpu_sources is not None and not packed.host_ready.query(), name
        if not keep_gpu_copy:
            packed.release_gpu()
        reg.register(name, weights)
        slot = reg.activate([name], {name})[name]
        assert packed.gpu_sources is None, name  # in the slot now: the GPU copy goes
        torch.cuda.current_stream().synchronize()
        assert packed.host_ready.query() != keep_gpu_copy, name  # only the pinned fill waited for it
        want = load_adapter(folder, model, 64, 1 << 30)
        assert_slot_equals(reg.slots, slot, reference_slot(want, model, torch.bfloat16))
        packed.wait_host()
        host = pack_weights(want, model.num_layers, torch.bfloat16, pin=False)
        assert torch.equal(bits(torch.cat(packed.chunks)), bits(torch.cat(host.chunks))), name

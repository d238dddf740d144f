"""The packed slot layout (`packing.pack_weights`): the CPU cache's only copy of an adapter, flat
and in slot order; a fill from it puts in a slot, bit for bit, what the reference fill puts there
(tests/worker/lora_harness.py); on CUDA, from the pinned layout or from its GPU copy, which a fill
takes without waiting for the copy back to pinned memory."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.lora import packing
from lorafleet.worker.lora.adapter import load_adapter
from lorafleet.worker.lora.packing import SLICE_ORDER, pack_weights
from lorafleet.worker.lora.slots import LoraSlots
from tests.worker.lora_harness import (
    assert_slot_equals,
    bits,
    cuda,
    layout_folders,
    make_cuda_registry,
    make_registry,
    reference_slot,
)


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


# -- CUDA ------------------------------------------------------------------------------------------------

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
def test_cuda_a_load_waits_for_the_check_not_for_the_copy_back(model, demo_adapters, monkeypatch):
    """The layout's copy back into pinned memory is held back here (the registry's stream sleeps
    ~0.1 s before it). `read` returns with it still queued; the fill takes the GPU copy, and the
    compute stream passes it with the copy back still queued. An adapter whose GPU copy was let
    go fills from the pinned buffers, waiting for the copy back on the GPU: both slots equal the
    reference, and the host buffers after `wait_host` equal the host's own layout."""
    # Warm up first: a read that compiles the packing and check kernels takes longer on the host
    # than the delay below, so run alone (nothing before it warmed them) the copy back was done
    # before `read` returned.
    warm = make_cuda_registry(model, torch.bfloat16, max_loras=2)
    warm.register("warm", warm.read(str(demo_adapters["chat"])))
    warm.activate(["warm"], {"warm"})
    torch.cuda.synchronize()
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

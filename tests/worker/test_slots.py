"""The slot pool (`LoraSlots`): all layers' stacks in one tensor per column, in the kernels' layout.

A fill is compared, bit for bit, with the reference fill done module by module into separately
allocated per-layer stacks (`ReferencePool`), for whole stacks, stale rows included. Its copies are
counted: one per piece (a run of layers of one column at one rank), not one per layer and module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lorafleet.kernels.lora.operands import lora_b_layout, new_lora_b
from lorafleet.worker.config import FUSED_SLICES, ModelConfig
from lorafleet.worker.lora import slots as slots_mod
from lorafleet.worker.lora.adapter import LoraWeights, load_adapter
from lorafleet.worker.lora.packing import SLICE_ORDER, pack_weights
from lorafleet.worker.lora.slots import LoraSlots
from tests.worker.lora_harness import bits, cuda, make_registry, random_weights, reference_slot, write_adapter


def deep(model: ModelConfig, layers: int = 6) -> ModelConfig:
    """The demo model's shapes with more layers (runs of layers are what the packed layout groups)."""
    return dataclasses.replace(model, num_layers=layers)


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


def test_slot_views_keep_the_kernel_layout(model):
    """Each layer's stacks are views of one [L, S, r_max, in|out] tensor per column, with exactly the
    shapes and strides per-layer tensors had (A contiguous, B rank-major as new_lora_b makes it)."""
    m = deep(model, 3)
    slots = LoraSlots(m, 3, 16, torch.device("cpu"), torch.bfloat16)
    ref = ReferencePool(m, 3, 16, torch.bfloat16)
    dora = m.num_layers * 3 * sum(out for fused in FUSED_SLICES for _, out in m.slice_sizes(fused)) * 4  # float32 g
    assert slots.nbytes() == sum(t.numel() * t.element_size() for d in (ref.a, ref.b) for t in d.values()) + dora
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


# -- CUDA ------------------------------------------------------------------------------------------------

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

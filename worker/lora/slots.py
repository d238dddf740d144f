"""GPU slot stacks: per layer and fused projection, A `[S, r_max, in]` and B `[S, out, r_max]` per slice.

B is indexed `[S, out, r_max]` but stored rank-major (`lora_ops.new_lora_b`: `[S, r_max, out]`
memory), so a slot's true-rank rows are one contiguous block and the kernels read exactly those
(on the H200 a rank-8 adapter in a rank-64 pool ran 10-20% faster than with out-major B).

Filling a slot copies an adapter in at its true rank (the slot's rank table says how many rows
are live), folds alpha/r into B, and sets rank 0 for slices the adapter does not target, so the
kernels do no work there. On CUDA the copy runs on a side stream from pinned memory and the step
that first uses the slot waits on its event, so a prefetch overlaps the running batch.

The host side is prepared once per adapter (`pack_weights`, called by `AdapterRegistry.read` off
the engine loop): every module's A rows and B's rank-major rows, pre-scaled and in the slot dtype,
back to back in a few flat buffers (pinned on CUDA), plus the adapter's rank table for every layer.
A fill is then only plain contiguous copies, one per A block and one per B block (issued by one
`_foreach_copy_`), and one copy of the rank table into the pool's `[layers, slices, S]` table.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from lorafleet.kernels.lora_ops import lora_b_layout, new_lora_b
from lorafleet.worker.config import FUSED_SLICES, ModelConfig
from lorafleet.worker.lora.adapter import LoraWeights, ModuleWeights

# Slot order of the slices in a layer: qkv's q, k, v, then o, gate, up, down (FUSED_SLICES order).
SLICE_ORDER: tuple[str, ...] = tuple(t for names in FUSED_SLICES.values() for t in names)
_COLUMN = {t: c for c, t in enumerate(SLICE_ORDER)}
# The caching host allocator rounds each pinned block up to a power of two: a few blocks of at most
# this size keep that rounding small (one 80 MiB buffer would take 128 MiB).
PINNED_CHUNK_BYTES = 16 << 20
# dtypes whose elementwise ops compute in float32 (opmath), so `b * s` in that dtype rounds exactly
# like `(b.float() * s).to(dtype)`.
_FLOAT32_OPMATH = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(slots=True)
class PackedLora:
    """An adapter laid out as the slots hold it (see the module docstring)."""

    dtype: torch.dtype
    pinned: bool
    chunks: list[torch.Tensor]  # flat buffers holding every block below
    # (k, rank, A rows [r*in], B rank-major rows [r*out]): k = layer * len(SLICE_ORDER) + column.
    blocks: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    ranks: torch.Tensor  # [num_layers, len(SLICE_ORDER)] int32, 0 = untargeted (pinned with the chunks)
    # The modules as views of the blocks (A [r, in], B [out, r] scaled, scaling 1): what the CPU cache keeps.
    views: dict[tuple[int, str], ModuleWeights] = field(default_factory=dict)
    # (k, A elements, B elements) per block: adapters of one shape share it, and the slots reuse the
    # copy targets they built for it.
    layout: tuple[tuple[int, int, int], ...] = ()
    sources: list[torch.Tensor] = field(default_factory=list)  # A0, B0, A1, B1, ... in block order

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, _, a, b in self.blocks)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor):
    """A numpy view of `t`'s elements as same-size integers (bits and strides kept; no copy)."""
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


def _bitwise_ok(m: ModuleWeights, dtype: torch.dtype) -> bool:
    """A and B already in `dtype` on the CPU: numpy copies their bits (no intra-op thread team, no GIL)."""
    return dtype in _FLOAT32_OPMATH and all(
        t.dtype == dtype and t.device.type == "cpu" and not t.requires_grad for t in (m.a, m.b)
    )


def _scaled_b_into(m: ModuleWeights, dst: torch.Tensor) -> None:
    """dst [r, out] = B^T with alpha/r folded in, rounding exactly as the old per-tensor preparation did."""
    b, s = m.b, m.scaling
    if b.dtype == dst.dtype and dst.dtype in _FLOAT32_OPMATH:
        if s == 1.0:
            dst.copy_(b.T)
        else:
            torch.mul(b.T, s, out=dst)
    elif s == 1.0 and m.a.dtype == dst.dtype:
        dst.copy_(b.T)  # converted straight to the slot dtype
    else:
        dst.copy_(b.T.float() * s)  # (b.float() * s).to(dtype)


def pack_weights(
    weights: LoraWeights, num_layers: int, dtype: torch.dtype, pin: bool, chunk_bytes: int | None = None
) -> PackedLora:
    """Lay `weights` out in slot order, in `dtype`, B transposed to rank-major and pre-scaled.

    Pinned buffers are cut into chunks of at most `chunk_bytes` (default PINNED_CHUNK_BYTES); an
    unpinned layout is one flat buffer. A module's blocks never straddle two chunks: a chunk holds
    its modules' A blocks, then their B blocks, so B blocks with one scaling are scaled by one op.
    Weights already in `dtype` are copied (B transposed) as bits by numpy, then B is scaled in place
    in `dtype`, which rounds exactly as `(b.float() * s).to(dtype)`; other weights go through torch.
    """
    if chunk_bytes is None:
        chunk_bytes = PINNED_CHUNK_BYTES if pin else 0
    cap = chunk_bytes // torch.empty((), dtype=dtype).element_size() if chunk_bytes else 0
    n = len(SLICE_ORDER)
    mods = sorted(
        ((layer * n + _COLUMN[target], m) for (layer, target), m in weights.modules.items()), key=lambda km: km[0]
    )
    groups: list[list[tuple[int, ModuleWeights]]] = []  # the modules of each chunk
    sizes: list[int] = []  # chunk sizes, elements
    for k, m in mods:
        need = m.a.numel() + m.b.numel()
        if not groups or (cap and sizes[-1] + need > cap):
            groups.append([])
            sizes.append(0)
        groups[-1].append((k, m))
        sizes[-1] += need
    chunks = [torch.empty(size, dtype=dtype, pin_memory=pin) for size in sizes]
    ranks = torch.zeros(num_layers, n, dtype=torch.int32, pin_memory=pin)
    blocks = []
    for chunk, group in zip(chunks, groups):
        a_off, b_off = 0, sum(m.a.numel() for _, m in group)
        scale_runs: list[list] = []  # [begin, end, scaling] over this chunk's B blocks
        for k, m in group:
            r, in_dim = m.a.shape
            out_dim = m.b.shape[0]
            a = chunk[a_off : a_off + r * in_dim]
            b = chunk[b_off : b_off + r * out_dim]
            if _bitwise_ok(m, dtype):
                _raw(a).reshape(r, in_dim)[...] = _raw(m.a)
                _raw(b).reshape(r, out_dim)[...] = _raw(m.b).T
                if m.scaling != 1.0:
                    if scale_runs and scale_runs[-1][2] == m.scaling and scale_runs[-1][1] == b_off:
                        scale_runs[-1][1] = b_off + b.numel()
                    else:
                        scale_runs.append([b_off, b_off + b.numel(), m.scaling])
            else:
                a.view(r, in_dim).copy_(m.a)
                _scaled_b_into(m, b.view(r, out_dim))
            ranks[k // n, k % n] = r
            blocks.append((k, r, a, b))
            a_off += a.numel()
            b_off += b.numel()
        for begin, end, scaling in scale_runs:
            chunk[begin:end].mul_(scaling)
    views = {(k // n, SLICE_ORDER[k % n]): ModuleWeights(a=a.view(r, -1), b=b.view(r, -1).T, scaling=1.0)
             for k, r, a, b in blocks}
    return PackedLora(
        dtype=dtype, pinned=pin, chunks=chunks, blocks=blocks, ranks=ranks, views=views,
        layout=tuple((k, a.numel(), b.numel()) for k, _r, a, b in blocks),
        sources=[t for _k, _r, a, b in blocks for t in (a, b)],
    )


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i], non_blocking=True) for all i, looped in C++ where torch has `_foreach_copy_`."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dst, src, non_blocking=True)
            return
        except (RuntimeError, TypeError, NotImplementedError):  # an older torch: the plain loop (idempotent)
            pass
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)


@dataclass(slots=True)
class FusedSlots:
    lora_a: list[torch.Tensor]  # per slice: [S, r_max, in]
    lora_b: list[torch.Tensor]  # per slice: [S, out, r_max] view of rank-major [S, r_max, out] memory
    ranks: list[list[int]]  # per slice: [S] true ranks on the host (0 = untargeted)
    ranks_device: torch.Tensor  # [n_slices, S] int32 (a view of LoraSlots.ranks_device)


class LoraSlots:
    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.num_layers = config.num_layers
        # Every layer's rank table in one tensor, [layers, slices (SLICE_ORDER), S]: a fill or a clear
        # updates one slot's column everywhere with one copy. Each FusedSlots sees its [n_slices, S] rows.
        self.ranks_device = torch.zeros(config.num_layers, len(SLICE_ORDER), num_slots, dtype=torch.int32,
                                        device=device)
        self.layers: list[dict[str, FusedSlots]] = []
        for layer_idx in range(config.num_layers):
            layer: dict[str, FusedSlots] = {}
            for fused, names in FUSED_SLICES.items():
                sizes = config.slice_sizes(fused)
                col = _COLUMN[names[0]]
                layer[fused] = FusedSlots(
                    lora_a=[torch.zeros(num_slots, max_rank, i, device=device, dtype=dtype) for i, _ in sizes],
                    lora_b=[new_lora_b(num_slots, o, max_rank, device=device, dtype=dtype) for _, o in sizes],
                    ranks=[[0] * num_slots for _ in names],
                    ranks_device=self.ranks_device[layer_idx, col : col + len(names)],
                )
            self.layers.append(layer)
        # In SLICE_ORDER per layer (index k): the slice's stacks as [S, r_max*in] / [S, r_max*out]
        # (B's rank-major storage), and its host rank list.
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._host_ranks: list[list[int]] = []
        for layer in self.layers:
            for fused, names in FUSED_SLICES.items():
                s = layer[fused]
                for j in range(len(names)):
                    if lora_b_layout(s.lora_b[j]) != "rank_major":  # a slot's [:r] rows must be one block
                        raise ValueError(f"LoraSlots needs rank-major B stacks, got {lora_b_layout(s.lora_b[j])}")
                    self._flat.append((s.lora_a[j].view(num_slots, -1), s.lora_b[j].transpose(1, 2).view(num_slots, -1)))
                    self._host_ranks.append(s.ranks[j])
        self._targets_cache: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        self.slot_max_rank = [0] * num_slots  # largest true rank over a slot's slices (0 = empty)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for s in layer.values()
            for t in (*s.lora_a, *s.lora_b)
        )

    def pack(self, weights: LoraWeights, pin: bool | None = None) -> PackedLora:
        """`weights` in this pool's layout (pinned on CUDA unless `pin` says otherwise)."""
        return pack_weights(weights, self.num_layers, self.dtype, self.device.type == "cuda" if pin is None else pin)

    def _targets(self, slot: int, packed: PackedLora) -> list[torch.Tensor]:
        """The slot regions `packed.sources` go to (cached per slot for the last layout seen there)."""
        cached = self._targets_cache.get(slot)
        if cached is not None and cached[0] == packed.layout:
            return cached[1]
        dst = []
        for k, na, nb in packed.layout:
            a, b = self._flat[k]
            dst += (a[slot, :na], b[slot, :nb])
        self._targets_cache[slot] = (packed.layout, dst)
        return dst

    def fill(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into `slot` (asynchronously on CUDA; call `wait` before using it).

        Uses `weights.packed` (the registry prepares it once per adapter); other weights are packed
        here first.
        """
        packed = weights.packed
        if packed is None or packed.dtype != self.dtype or packed.ranks.shape[0] != self.num_layers:
            packed = self.pack(weights)
        dst = self._targets(slot, packed)
        src = packed.sources
        ranks = packed.ranks.view(-1).tolist()
        for lst, r in zip(self._host_ranks, ranks):
            lst[slot] = r
        self.slot_max_rank[slot] = max(ranks, default=0)
        stream = self._copy_stream
        if stream is not None:
            # The slot's old contents may still be read by steps queued on the compute stream, and
            # `clear` zeroed its ranks there: order the copy after both.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            _copy_all(dst, src)
            self.ranks_device[:, :, slot].copy_(packed.ranks, non_blocking=True)
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._ready[slot] = event

    def clear(self, slot: int) -> None:
        """Mark a slot empty (ranks 0); the stale rows are never read."""
        for lst in self._host_ranks:
            lst[slot] = 0
        self.slot_max_rank[slot] = 0
        self.ranks_device[:, :, slot] = 0
        self._ready.pop(slot, None)

    def rank_bound(self, token_slots: torch.Tensor) -> int:
        """The largest true rank among the slots `token_slots` names (-1 = none), 0 if it names none."""
        used = {s for s in token_slots.reshape(-1).tolist() if s >= 0}
        return max((self.slot_max_rank[s] for s in used), default=0)

    def wait(self, slots: list[int]) -> None:
        """Make the compute stream wait for pending copies into these slots (no host sync)."""
        for slot in slots:
            event = self._ready.pop(slot, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

"""GPU slot stacks: per layer and fused projection, A `[S, r_max, in]` and B `[S, out, r_max]` per slice.

Storage. Each slice column (SLICE_ORDER: q, k, v, o, gate, up, down) owns one A tensor
`[L, S, r_max, in]` and one B tensor `[L, S, r_max, out]` for all L layers. Layer l's stacks are
views of them: `lora_a[j]` = A[l], a contiguous `[S, r_max, in]`, and `lora_b[j]` =
`B[l].transpose(1, 2)`, indexed `[S, out, r_max]` with rank-major memory, the strides
`operands.new_lora_b` gives (`lora_b_layout` == "rank_major"). So the kernels see exactly what
per-layer tensors gave them, and a slot's true-rank rows are one contiguous block per layer (on the
H200 a rank-8 adapter in a rank-64 pool ran 10-20% faster than with out-major B).

Filling a slot copies an adapter in at its true rank (the slot's rank table says how many rows
are live), folds alpha/r into B, and sets rank 0 for slices the adapter does not target, so the
kernels do no work there (rows past a layer's rank are never read, so stale ones are harmless).
On CUDA the copy runs on a side stream, from pinned memory or from the layout's copy still on the
GPU (kept for the adapters read last), and the step that first uses the slot waits on its event,
so a prefetch overlaps the running batch.

Each adapter arrives laid out as the storage holds it (`packing.PackedLora`, made once per adapter
off the engine loop: worker/lora/packing.py).

A CPU -> CUDA copy into a non-contiguous tensor is staged by PyTorch itself: one cudaMemcpyAsync
into a contiguous temporary from the caching allocator, then one device copy kernel into the
view, both on the current (here the side) stream. A fill so needs one piece's bytes of extra GPU
memory (at most one pinned buffer), which the allocator then keeps cached for the side stream; if
even that cannot be allocated, the pieces go layer by layer into the contiguous per-layer rows
instead, with no temporary.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from lorafleet.kernels.lora.dora import dora_epilogue
from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.lora.operands import lora_b_layout
from lorafleet.worker.config import FUSED_SLICES, ModelConfig
from lorafleet.worker.lora.adapter import LoraWeights
from lorafleet.worker.lora.packing import _COLUMN, SLICE_ORDER, PackedLora, _copy_all, pack_weights


@dataclass(slots=True)
class FusedSlots:
    lora_a: list[torch.Tensor]  # per slice: [S, r_max, in] (a view of the column's [L, S, r_max, in])
    lora_b: list[torch.Tensor]  # per slice: [S, out, r_max] view of rank-major [S, r_max, out] memory
    ranks: list[list[int]]  # per slice: [S] true ranks on the host (0 = untargeted)
    ranks_device: torch.Tensor  # [n_slices, S] int32 (a view of LoraSlots.ranks_device)
    dora_scale: torch.Tensor  # [S, Σ out] float32: DoRA's g per slot (read only where is_dora is set)


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
        # Per column (SLICE_ORDER): A [L, S, r_max, in] and B [L, S, r_max, out] (rank-major B), all layers.
        dims = [size for fused in FUSED_SLICES for size in config.slice_sizes(fused)]
        self._storage: list[tuple[torch.Tensor, torch.Tensor]] = [
            tuple(torch.zeros(config.num_layers, num_slots, max_rank, d, device=device, dtype=dtype) for d in io)
            for io in dims
        ]
        # DoRA (worker/lora/dora.py): per fused projection g `[L, S, Σ out]` float32, and per slot
        # whether it holds a DoRA adapter (host and device; the epilogue reads the device one, so a
        # captured graph sees fills without re-capture).
        self.dora_scale = {fused: torch.ones(config.num_layers, num_slots, sum(o for _, o in config.slice_sizes(fused)),
                                             dtype=torch.float32, device=device) for fused in FUSED_SLICES}
        self.is_dora = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.slot_dora = [False] * num_slots
        self._dora_step: tuple[LoraMeta | None, bool] = (None, False)  # the last step's meta, and its answer
        self.layers: list[dict[str, FusedSlots]] = []
        self._host_ranks: list[list[int]] = []  # per layer, in SLICE_ORDER (index k): the slice's host ranks
        for layer_idx in range(config.num_layers):
            layer: dict[str, FusedSlots] = {}
            for fused, names in FUSED_SLICES.items():
                cols = [_COLUMN[t] for t in names]
                s = layer[fused] = FusedSlots(
                    lora_a=[self._storage[c][0][layer_idx] for c in cols],
                    lora_b=[self._storage[c][1][layer_idx].transpose(1, 2) for c in cols],
                    ranks=[[0] * num_slots for _ in names],
                    ranks_device=self.ranks_device[layer_idx, cols[0] : cols[0] + len(names)],
                    dora_scale=self.dora_scale[fused][layer_idx],
                )
                for a, b in zip(s.lora_a, s.lora_b):  # what new_lora_b / torch.zeros would have given
                    if lora_b_layout(b) != "rank_major" or not a.is_contiguous():
                        raise ValueError(f"LoraSlots views lost their layout: B {lora_b_layout(b)}, A {a.stride()}")
                self._host_ranks += s.ranks
            self.layers.append(layer)
        self._targets_cache: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        self.slot_max_rank = [0] * num_slots  # largest true rank over a slot's slices (0 = empty)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}

    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for pair in self._storage for t in pair)
                + sum(t.numel() * t.element_size() for t in self.dora_scale.values()))

    def pack(self, weights: LoraWeights, pin: bool | None = None) -> PackedLora:
        """`weights` in this pool's layout (pinned on CUDA unless `pin` says otherwise)."""
        return pack_weights(weights, self.num_layers, self.dtype, self.device.type == "cuda" if pin is None else pin)

    def _targets(self, slot: int, packed: PackedLora) -> list[torch.Tensor]:
        """Where `packed.sources` go: [layers, rank, dim] views of the storage at `slot` (cached per
        slot for the last layout seen there)."""
        cached = self._targets_cache.get(slot)
        if cached is not None and cached[0] == packed.layout:
            return cached[1]
        dst = [self._storage[col][half][layer : layer + count, slot, :r] for col, half, layer, count, r in packed.layout]
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
        on_gpu = bool(packed.gpu_sources) and packed.gpu_sources[0].device == self.ranks_device.device
        src = packed.gpu_sources if on_gpu else packed.sources
        ranks = packed.ranks.view(-1).tolist()
        for lst, r in zip(self._host_ranks, ranks):
            lst[slot] = r
        self.slot_max_rank[slot] = max(ranks, default=0)
        stream = self._copy_stream
        if stream is not None:
            # The slot's old contents may still be read by steps queued on the compute stream, and
            # `clear` zeroed its ranks there: order the copy after both, and after the layout's
            # own copies (made on another stream: its memory is kept until this one is done too).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            ready = packed.gpu_ready if on_gpu else packed.host_ready
            if ready is not None:
                stream.wait_event(ready)
            if on_gpu:  # once per buffer the pieces view (one, for a layout made by PackPlan.run)
                for piece in {p.untyped_storage().data_ptr(): p for p in src}.values():
                    piece.record_stream(stream)
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            try:
                _copy_all(dst, src)
            except torch.cuda.OutOfMemoryError:  # no room to stage a strided piece: layer by layer, in place
                _copy_all([t for d in dst for t in d.unbind(0)], [t for s in src for t in s.unbind(0)])
            self.ranks_device[:, :, slot].copy_(packed.ranks, non_blocking=True)
            if weights.dora:
                for fused, g in weights.dora_scale.items():
                    self.dora_scale[fused][:, slot].copy_(g, non_blocking=True)
            if weights.dora or self.slot_dora[slot]:
                self.is_dora[slot : slot + 1].fill_(int(weights.dora))
        self.slot_dora[slot] = weights.dora
        self._dora_step = (None, False)
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
        if self.slot_dora[slot]:
            self.is_dora[slot] = 0
            self.slot_dora[slot] = False
            self._dora_step = (None, False)
        self._ready.pop(slot, None)

    def rank_bound(self, token_slots: torch.Tensor) -> int:
        """The largest true rank among the slots `token_slots` names (-1 = none), 0 if it names none."""
        used = {s for s in token_slots.reshape(-1).tolist() if s >= 0}
        return max((self.slot_max_rank[s] for s in used), default=0)

    def apply_dora(self, layer: int, fused: str, y: torch.Tensor, delta: torch.Tensor | None, meta: LoraMeta,
                   bias: torch.Tensor | None, backend: str, graph: bool) -> None:
        """Rescale the DoRA tokens' rows of a fused projection's output in place (`kernels/lora/dora.py`):
        y = b + g ⊙ (y + delta - b), their delta rows zeroed. Outside a graph, only when a slot of the
        step holds a DoRA adapter; in a graph whenever any slot holds one (which tokens are DoRA ones
        is data there; the decode graphs are keyed by `any_dora`, so one captured without the
        epilogue is never replayed while a DoRA adapter is resident)."""
        if not (self.any_dora() if graph else self._step_has_dora(meta)):
            return
        dora_epilogue(y, delta, self.layers[layer][fused].dora_scale, self.is_dora, meta.token_slots, bias, backend)

    def any_dora(self) -> bool:
        """Whether any slot holds a DoRA adapter."""
        return any(self.slot_dora)

    def _step_has_dora(self, meta: LoraMeta) -> bool:
        """Whether a slot of the step holds a DoRA adapter (asked once per step: every layer's
        projections share the step's meta)."""
        if not self.any_dora():
            return False
        if self._dora_step[0] is not meta:
            self._dora_step = (meta, any(self.slot_dora[slot] for slot, _, _ in meta.segments))
        return self._dora_step[1]

    def wait(self, slots: list[int]) -> None:
        """Make the compute stream wait for pending copies into these slots (no host sync)."""
        for slot in slots:
            event = self._ready.pop(slot, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

"""GPU slot stacks: per layer and fused projection, A `[S, r_max, in]` and B `[S, out, r_max]` per slice.

B is indexed `[S, out, r_max]` but stored rank-major (`lora_ops.new_lora_b`: `[S, r_max, out]`
memory), so a slot's true-rank rows are one contiguous block and the kernels read exactly those
(on the H200 a rank-8 adapter in a rank-64 pool ran 10-20% faster than with out-major B).

Filling a slot copies an adapter in at its true rank (the slot's rank table says how many rows
are live), folds alpha/r into B, and sets rank 0 for slices the adapter does not target, so the
kernels do no work there. On CUDA the copy runs on a side stream from pinned memory and the step
that first uses the slot waits on its event, so a prefetch overlaps the running batch.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from lorafleet.kernels.lora_ops import new_lora_b
from lorafleet.worker.config import FUSED_SLICES, ModelConfig
from lorafleet.worker.lora.adapter import LoraWeights


@dataclass(slots=True)
class FusedSlots:
    lora_a: list[torch.Tensor]  # per slice: [S, r_max, in]
    lora_b: list[torch.Tensor]  # per slice: [S, out, r_max] view of rank-major [S, r_max, out] memory
    ranks: list[list[int]]  # per slice: [S] true ranks on the host (0 = untargeted)
    ranks_device: torch.Tensor  # [n_slices, S] int32


class LoraSlots:
    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.layers: list[dict[str, FusedSlots]] = []
        for _ in range(config.num_layers):
            layer: dict[str, FusedSlots] = {}
            for fused, names in FUSED_SLICES.items():
                sizes = config.slice_sizes(fused)
                layer[fused] = FusedSlots(
                    lora_a=[torch.zeros(num_slots, max_rank, i, device=device, dtype=dtype) for i, _ in sizes],
                    lora_b=[new_lora_b(num_slots, o, max_rank, device=device, dtype=dtype) for _, o in sizes],
                    ranks=[[0] * num_slots for _ in names],
                    ranks_device=torch.zeros(len(names), num_slots, dtype=torch.int32, device=device),
                )
            self.layers.append(layer)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: dict[int, torch.cuda.Event] = {}

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for s in layer.values()
            for t in (*s.lora_a, *s.lora_b)
        )

    def fill(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into `slot` (asynchronously on CUDA; call `wait` before using it)."""
        stream = self._copy_stream
        if stream is not None:
            # The slot's old contents may still be read by steps queued on the compute stream, and
            # `clear` zeroed its ranks there: order the copy after both.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            for layer_idx, layer in enumerate(self.layers):
                for fused, names in FUSED_SLICES.items():
                    s = layer[fused]
                    for j, target in enumerate(names):
                        m = weights.modules.get((layer_idx, target))
                        r = 0 if m is None else m.rank
                        if m is not None:
                            s.lora_a[j][slot, :r].copy_(m.a, non_blocking=True)
                            b = m.b if m.scaling == 1.0 else m.b * m.scaling  # [out, r]
                            # The slot's first r rows of the rank-major storage: one contiguous block.
                            s.lora_b[j].transpose(1, 2)[slot, :r].copy_(b.T, non_blocking=True)
                        s.ranks[j][slot] = r
                    s.ranks_device[:, slot].copy_(
                        torch.tensor([s.ranks[j][slot] for j in range(len(names))], dtype=torch.int32),
                        non_blocking=True,
                    )
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._ready[slot] = event

    def clear(self, slot: int) -> None:
        """Mark a slot empty (ranks 0); the stale rows are never read."""
        for layer in self.layers:
            for s in layer.values():
                for j in range(len(s.ranks)):
                    s.ranks[j][slot] = 0
                s.ranks_device[:, slot] = 0
        self._ready.pop(slot, None)

    def wait(self, slots: list[int]) -> None:
        """Make the compute stream wait for pending copies into these slots (no host sync)."""
        for slot in slots:
            event = self._ready.pop(slot, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)


"""Bring a step's LoRA weights into the GPU's L2 cache ahead of the kernels that read them (Hopper+).

A decode step is bound by DRAM bandwidth almost everywhere, except in a few phases: the paged
attention reads its K/V at about 70% of the copy bandwidth on the H200, and the row kernels
between the GEMMs hardly read at all. Adapter weights that the next LoRA launches will read can
be fetched into L2 during such a phase, so those launches then read them from L2 while the base
GEMM beside them keeps DRAM to itself.

`launch_lora_prefetch` issues, for every active slot of the step (`LoraMeta.chunk_slot`, each slot
once), bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, the copy engine's, no registers, no data
returned) of the slot's true-rank rows of A and, with rank-major B (`lora_ops.new_lora_b`, what the
slot pool stores), of B, marked evict-last so the streaming reads around them are evicted first. It
is a hint: nothing waits for the lines, and nothing is wrong if they are gone by the time they are
read. Grids depend only on the meta's launch bound and the slice count, so a decode graph can
capture it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorafleet.kernels import interpreting
from lorafleet.kernels.lora_ops import LoraMeta, lora_b_layout

LANES = 32  # bulk prefetches a program issues at once: one a thread of its single warp


@triton.jit
def _bulk_prefetch_l2(ptrs, nbytes):
    """One bulk L2 prefetch (evict-last) of nbytes at each pointer; none where nbytes <= 0."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b64 pol;
        setp.gt.s32 p, $2, 0;
        createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
        @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _lora_l2_prefetch_kernel(
    p0, p1, p2, p3, p4, p5,  # the ranges' tensors: A of slices 0-2, then B of slices 0-2
    ranks_ptr,
    chunk_slot_ptr,
    stride_rs,
    slot0, slot1, slot2, slot3, slot4, slot5,  # elements from one slot to the next
    row0, row1, row2, row3, row4, row5,  # elements a rank row (0: the range is skipped)
    ELEM_BYTES: tl.constexpr,
    LANES: tl.constexpr,
):
    """Program (chunk, range): the chunk's slot's rank rows of one range, each slot once."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.load(chunk_slot_ptr + pid_c)
    prev = tl.load(chunk_slot_ptr + tl.maximum(pid_c - 1, 0))
    if slot < 0:
        return
    if pid_c > 0 and prev == slot:  # chunks are sorted by slot: the slot's first chunk prefetches
        return
    if pid_r == 0:
        base, slot_elems, row_elems = p0, slot0, row0
    elif pid_r == 1:
        base, slot_elems, row_elems = p1, slot1, row1
    elif pid_r == 2:
        base, slot_elems, row_elems = p2, slot2, row2
    elif pid_r == 3:
        base, slot_elems, row_elems = p3, slot3, row3
    elif pid_r == 4:
        base, slot_elems, row_elems = p4, slot4, row4
    else:
        base, slot_elems, row_elems = p5, slot5, row5
    if row_elems == 0:  # not prefetched (also every padding slice: its rank row does not exist)
        return
    rank = tl.load(ranks_ptr + (pid_r % 3) * stride_rs + slot)
    total = rank * row_elems  # elements of the slot's true-rank rows, contiguous
    # Pieces of whole 16-byte units, one a lane; lanes past the end prefetch nothing.
    unit = 16 // ELEM_BYTES
    piece = tl.cdiv(tl.cdiv(total, LANES), unit) * unit
    offs = tl.arange(0, LANES) * piece
    size = tl.minimum(tl.maximum(total - offs, 0), piece) * ELEM_BYTES
    ptrs = base + slot.to(tl.int64) * slot_elems + offs
    _bulk_prefetch_l2(ptrs, size.to(tl.int32))


def prefetch_supported(t: torch.Tensor) -> bool:
    """Bulk L2 prefetches need a CUDA device of compute capability 9.0 or newer (not the interpreter)."""
    return t.is_cuda and not interpreting() and torch.cuda.get_device_capability(t.device) >= (9, 0)


def prefetch_ranges(
    lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], parts: str = "ab"
) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, elements a slot, elements a rank row) of each range, A's slices then B's, 0 rows
    where the range is not prefetched: not asked for (`parts`), B not rank-major (a slot's rank
    columns are then spread over all its rows), or an address that is not 16-byte aligned."""
    ranges = []
    for part, stacks in (("a", lora_a), ("b", lora_b)):
        for t in stacks:
            if part == "a":
                slot_elems, row_elems, ok = t.stride(0), t.shape[2], t.stride(2) == 1 and t.stride(1) == t.shape[2]
            else:
                slot_elems, row_elems, ok = t.stride(0), t.shape[1], lora_b_layout(t) == "rank_major"
            esize = t.element_size()
            aligned = t.data_ptr() % 16 == 0 and (slot_elems * esize) % 16 == 0 and (row_elems * esize) % 16 == 0
            ranges.append((t, slot_elems, row_elems if part in parts and ok and aligned else 0))
    return ranges


def launch_lora_prefetch(
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks_device: torch.Tensor,
    meta: LoraMeta,
    parts: str = "ab",
) -> None:
    """Prefetch (on the current stream) the true-rank rows of A and/or B (`parts`) of every slot
    the meta's chunks name into L2. A no-op where `prefetch_supported` is false or nothing is asked."""
    n_slices = len(lora_a)
    if n_slices == 0 or n_slices > 3 or len(lora_b) != n_slices:
        raise ValueError(f"1-3 slices of A and B, got {len(lora_a)} and {len(lora_b)}")
    if meta.chunk_slot is None:
        raise ValueError("meta has no chunk list; build it with build_lora_meta")
    if tuple(ranks_device.shape) != (n_slices, lora_a[0].shape[0]) or ranks_device.dtype != torch.int32:
        raise ValueError(f"ranks_device must be [n_slices={n_slices}, S={lora_a[0].shape[0]}] int32")
    if not prefetch_supported(lora_a[0]) or meta.grid_chunks == 0:
        return
    if len({t.element_size() for t in (*lora_a, *lora_b)}) != 1:
        raise ValueError("A and B must share one dtype")
    ranges = prefetch_ranges(lora_a, lora_b, parts)
    if not any(row for _, _, row in ranges):
        return
    a_ranges, b_ranges = ranges[:n_slices], ranges[n_slices:]
    pad = [(lora_a[0], 0, 0)] * (3 - n_slices)
    ranges = a_ranges + pad + b_ranges + pad
    _lora_l2_prefetch_kernel[(meta.grid_chunks, 6)](
        *(t for t, _, _ in ranges),
        ranks_device,
        meta.chunk_slot,
        ranks_device.stride(0),
        *(s for _, s, _ in ranges),
        *(r for _, _, r in ranges),
        ELEM_BYTES=lora_a[0].element_size(),
        LANES=LANES,
        num_warps=1,
    )

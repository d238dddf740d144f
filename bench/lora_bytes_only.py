"""An ideal LoRA side path for experiments: the adapters' bytes read, nothing computed (H200).

`bench/overlap_sweep.py`'s "bytes only" variants put `launch_shrink` and `launch_expand` below in
place of `triton_lora`'s (`linear_lora_deferred` looks them up at each call), so the engine's side
path beside every decode GEMM reads exactly the bytes the real kernels must read (each active
slot's true-rank rows of A, then of B, at full width with 16-byte loads, many programs each), and
the delta is zeroed instead of computed. The outputs are wrong (no adapter applied); the step's
time is what the LoRA kernels would cost if they did no math and had no chains of dependent
loads: a bound on what any kernel pair could reach beside these GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels.lora.launch import LoraLaunch

PIECES = 8  # programs a (slot, slice) range
BLOCK = 4096  # elements a program loads per iteration


@triton.jit
def _read_ranges_kernel(
    p0, p1, p2, ranks_ptr, chunk_slot_ptr, sink_ptr, zero_ptr, zero_numel, stride_rs, slot0, slot1, slot2, row0,
    row1, row2, PIECES: tl.constexpr, BLOCK: tl.constexpr, ZERO: tl.constexpr, PROBE: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_p = tl.program_id(2)
    if ZERO:  # chunk 0's programs zero y (the delta the real expand would have stored)
        if pid_c == 0:
            share = tl.cdiv(tl.cdiv(zero_numel, 3 * PIECES), BLOCK) * BLOCK
            z_lo = (pid_r * PIECES + pid_p) * share
            for z in range(z_lo, tl.minimum(z_lo + share, zero_numel), BLOCK):
                offs_z = z + tl.arange(0, BLOCK)
                tl.store(zero_ptr + offs_z, tl.zeros((BLOCK,), dtype=zero_ptr.dtype.element_ty), mask=offs_z < zero_numel)
    slot = tl.load(chunk_slot_ptr + pid_c)
    if slot < 0:
        return
    if pid_r == 0:
        base, slot_elems, row_elems = p0, slot0, row0
    elif pid_r == 1:
        base, slot_elems, row_elems = p1, slot1, row1
    else:
        base, slot_elems, row_elems = p2, slot2, row2
    if row_elems == 0:
        return
    total = tl.load(ranks_ptr + pid_r * stride_rs + slot) * row_elems
    piece = tl.cdiv(tl.cdiv(total, PIECES), BLOCK) * BLOCK
    lo = pid_p * piece
    hi = tl.minimum(lo + piece, total)
    ptr = base + slot.to(tl.int64) * slot_elems
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(lo, hi, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < hi, other=0.0).to(tl.float32)
    s = tl.sum(acc)
    if PROBE:  # tests: every program's sum at sink[program]
        tl.store(sink_ptr + (pid_c * 3 + pid_r) * PIECES + pid_p, s)
    elif s == 123456789.0:  # never (keeps the loads)
        tl.store(sink_ptr, s)


_SINK: dict[torch.device, torch.Tensor] = {}


def _read(stacks: list[torch.Tensor], plan: LoraLaunch, row_dim: int, zero: torch.Tensor | None = None,
          probe: torch.Tensor | None = None) -> None:
    """Read each active slot's true-rank rows of each stack (row_dim: the stack's dim along a rank row),
    once a chunk as the real kernels do. probe: fp32 `[grid_chunks * 3 * PIECES]`, zeroed, takes
    each program's sum of what it read (tests)."""
    meta = plan.meta
    if meta.grid_chunks == 0:
        return
    dev = stacks[0].device
    if dev not in _SINK:  # made once (setdefault's argument would be a fill launch in every captured call)
        _SINK[dev] = torch.zeros(1, dtype=torch.float32, device=dev)
    sink = probe if probe is not None else _SINK[dev]
    ranges = [(t, t.stride(0), t.shape[row_dim]) for t in stacks] + [(stacks[0], 0, 0)] * (3 - len(stacks))
    _read_ranges_kernel[(meta.grid_chunks, 3, PIECES)](
        *(t for t, _, _ in ranges), plan.ranks_device, meta.chunk_slot, sink, sink if zero is None else zero,
        0 if zero is None else zero.numel(), plan.ranks_device.stride(0), *(s for _, s, _ in ranges),
        *(r for _, _, r in ranges), PIECES=PIECES, BLOCK=BLOCK, ZERO=zero is not None,
        PROBE=probe is not None, num_warps=4,
    )


def launch_shrink(plan: LoraLaunch, zero: torch.Tensor | None = None) -> None:
    """Read A's true-rank rows of the active slots (A `[S, r_max, in]`: rank rows of `in` elements)."""
    plan.shrink_zeroes = zero is not None
    _read(plan.lora_a, plan, 2, zero)


def launch_expand(plan: LoraLaunch, y: torch.Tensor, store: bool = False) -> None:
    """Read B's true-rank rows (rank-major storage `[S, r_max, out]`: rank rows of `out` elements),
    and zero y (contiguous) when the real expand would have stored into it."""
    if not plan.b_rank_major:
        raise ValueError("the bytes-only side path reads rank-major B (the slot pool's)")
    _read(plan.lora_b, plan, 1, y if store else None)

"""Triton kernels for the multi-LoRA side path: a segmented shrink then a segmented expand.

Semantics (same as `lora_ops.add_lora_reference`):

    for each chunk c (<= chunk_size (token, entry) pairs of one slot, from LoraMeta):
        for each slice s with r = ranks[s, slot] > 0:
            h = x[tokens(c)] @ A_s[slot, :r].T                       # shrink  [rows, r]
            y[tokens(c), cols_s] += (scale(c) * h) @ B_s[slot, :, :r].T  # expand  [rows, out_s]

Two launches per projection group (all slices in each):
- shrink: grid (chunks, SPLIT_K, n_slices * rank_blocks). Each program reduces one K range of
  one 16-wide block of true rank; blocks past the slot's rank exit before loading anything, so a
  rank-8 adapter in a rank-64 pool reads rank 8. Partials go to `[SPLIT_K, T*k, n_slices*R_PAD]`
  fp32 without atomics; the expand sums them (deterministic, no zeroing launch).
- expand: grid (chunks, column groups of all slices). Sums the partials once, applies each
  pair's scale, then for each BLOCK_N tile of its group multiplies by B's true-rank columns
  (masked loads: the pool's padding is never read; with rank-major B the rows past the true rank
  are not even in the same sectors) and adds into y. With k = 1 every token is in exactly
  one chunk, so a plain read-modify-write is race-free; with k > 1 two chunks can own the same
  row, so the add is atomic. With k = 1 it can also store instead (`launch_expand(store=True)`):
  into a buffer nothing zeroed, whose rows of tokens without an adapter it leaves alone
  (`LoraMeta.has_lora` tells the reader which rows are defined).

Rank tiles cover `meta.rank_bound` (the step's largest true rank, set by the caller), not the
pool's r_max, so a step of rank-8 adapters in a rank-64 pool computes and sums rank-8 tiles.
On Hopper and newer the expand is launched with programmatic dependent launch: it starts while
the shrink's programs run, does its prologue (chunk, slot, rank, tokens, scales, its first tile
of B and, when it adds into y non-atomically and the shrink did not zero y, of y), and waits for
the partials with `gdc_wait`. Both kernels issue their loads in as few dependent rounds as they
can: these programs are bound by load latency, which grows when a GEMM beside them keeps memory
busy.

Grids depend only on (T, k, max_slots), the rank bound, the weight shapes and the meta's launch
bound on chunks (`LoraMeta.launch_chunks`: max_chunks unless the caller knows better); padding
chunks (slot -1) exit at once. No host syncs, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorafleet.kernels.lora_ops import LoraMeta, _check_shapes, lora_b_layout

BLOCK_R = 16  # rank block: tl.dot's smallest K / N


@dataclass(frozen=True, slots=True)
class LoraKernelConfig:
    """Launch parameters; `pick_config` chooses them per call (a captured graph keeps its own)."""

    split_k: int
    block_k: int
    block_n: int
    n_per_prog: int = 512
    shrink_warps: int = 4
    expand_warps: int = 4
    num_stages: int = 3


def pick_config(num_chunks: int, n_slices: int, in_features: int, chunk_size: int) -> LoraKernelConfig:
    """Aim the shrink at ~512 programs: split K finely when few chunks are active (decode with few
    adapters), little when many are; likewise give each expand program fewer columns when few
    chunks are active. Tuned on the H200 with `bench/kernels.py --sweep`. (Many columns a program
    when many chunks meet gate/up's wide slices, 2048, was faster alone in the sweep, 38.8 -> 34.6 µs
    at 64 tokens on 64 adapters, and slower in the engine, where the expand runs beside the GEMM on
    the SMs it leaves free: 64 adapters 8,175 -> 7,830 tok/s. Not used.)"""
    block_k = 128 if chunk_size <= 16 else 64
    by_chunks = triton.next_power_of_2(max(1, -(-512 // max(1, num_chunks * n_slices))))
    split_k = max(1, min(-(-in_features // 512), by_chunks))
    n_per_prog = 128 if num_chunks <= 4 else 256 if num_chunks * n_slices < 256 else 512
    block_n = 128 if chunk_size <= 16 else 64
    return LoraKernelConfig(
        split_k=split_k, block_k=block_k, block_n=block_n, n_per_prog=max(n_per_prog, block_n)
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper or newer, a Triton that can launch with it, and not
    turned off with LORAFLEET_PDL=0."""
    if _interpreting() or not torch.cuda.is_available() or os.environ.get("LORAFLEET_PDL", "1") == "0":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    has_option = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_option and hasattr(tl.extra.cuda, "gdc_wait") and torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def _lora_shrink_kernel(
    # pointers
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    ranks_ptr,
    chunk_slot_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    sorted_token_ptr,
    part_ptr,
    zero_ptr,
    # sizes
    K,
    K_PER_SPLIT,
    ZERO_NUMEL,
    # strides
    stride_xt,
    stride_as,
    stride_ar,
    stride_rs,
    stride_ps,
    stride_pm,
    # meta-parameters
    R_MAX: tl.constexpr,
    R_PAD: tl.constexpr,
    R_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    ZERO: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    """part[split, pair, s*R_PAD + r] = Σ_{k in split} x[token(pair), k] · A_s[slot, r, k].

    x `[T, K]` (unit stride in K); A_s `[S, R_MAX, K]` (unit stride in K); part fp32.
    ZERO: first, every program (padding ones too) zeroes its share of the contiguous buffer at
    zero_ptr (ZERO_NUMEL elements): the expand's output when it accumulates into a fresh delta,
    which then needs no memset launch of its own.
    """
    if PDL:  # every program has started: the expand may launch and run its prologue meanwhile
        tl.extra.cuda.gdc_launch_dependents()
    pid_c = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_sr = tl.program_id(2)
    if ZERO:
        n_prog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        # int32 offsets: launch_shrink refuses a buffer whose last share would pass 2**31
        pid = (pid_c * tl.num_programs(1) + pid_k) * tl.num_programs(2) + pid_sr
        share = tl.cdiv(tl.cdiv(ZERO_NUMEL, n_prog), ZERO_BLOCK) * ZERO_BLOCK
        zeros = tl.zeros((ZERO_BLOCK,), dtype=zero_ptr.dtype.element_ty)
        for z0 in range(pid * share, tl.minimum(pid * share + share, ZERO_NUMEL), ZERO_BLOCK):
            offs_z = z0 + tl.arange(0, ZERO_BLOCK)
            tl.store(zero_ptr + offs_z, zeros, mask=offs_z < ZERO_NUMEL)
    # Loads in as few dependent rounds as possible (latency, not bandwidth, bounds these programs,
    # the more so beside a GEMM that keeps memory busy): chunk slot, start and end together; then
    # the rank and the tokens; then x and A.
    slot = tl.load(chunk_slot_ptr + pid_c)
    start = tl.load(chunk_start_ptr + pid_c)
    end = tl.load(chunk_end_ptr + pid_c)
    if slot < 0:
        return
    s = pid_sr // R_BLOCKS
    r0 = (pid_sr % R_BLOCKS) * BLOCK_RANK
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), tl.minimum(R_MAX, R_PAD))
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    if r0 >= rank:
        return
    if s == 0:
        a_ptr = a0_ptr
    elif s == 1:
        a_ptr = a1_ptr
    else:
        a_ptr = a2_ptr
    offs_r = r0 + tl.arange(0, BLOCK_RANK)
    r_mask = offs_r < rank
    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar  # [1, BLOCK_RANK]

    acc = tl.zeros((BLOCK_M, BLOCK_RANK), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    # Written even when this split's K range is empty, so the expand can sum every split.
    p = part_ptr + pid_k * stride_ps + offs_m[:, None].to(tl.int64) * stride_pm + s * R_PAD + offs_r[None, :]
    tl.store(p, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    # pointers
    y_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    ranks_ptr,
    chunk_slot_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    sorted_token_ptr,
    sorted_scale_ptr,
    part_ptr,
    # sizes
    OUT0,
    OUT1,
    OUT2,
    GROUPS0,
    GROUPS1,
    SPLIT_K,
    # strides
    stride_yt,
    stride_rs,
    stride_ps,
    stride_pm,
    # meta-parameters
    R_MAX: tl.constexpr,
    R_PAD: tl.constexpr,
    R_BLOCK: tl.constexpr,
    B_RANK_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_PER_PROG: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ATOMIC: tl.constexpr,
    PDL: tl.constexpr,
    Y_EARLY: tl.constexpr,
    STORE: tl.constexpr,
):
    """y[token(pair), col_s + n] += scale(pair) · Σ_r part[:, pair, s*R_PAD + r] · B_s[slot, n, r].

    One program: one chunk × N_PER_PROG columns of one slice, in BLOCK_N tiles, so the chunk's
    rank-r activations are summed over the splits once and reused for every tile.
    y `[T, Σout]` (unit stride in columns); B_s indexed `[S, OUT_s, R_MAX]`: rank-major memory
    (stride 1 along n, OUT_s along r) when B_RANK_MAJOR, else contiguous.
    STORE (k = 1 only): `=` instead of `+=`, y not read; a slot with rank 0 for the slice stores
    zeros. Rows of tokens in no chunk are left as they were.
    Y_EARLY: the first tile's y is loaded before `gdc_wait` (not with STORE or ATOMIC, nor when the
    shrink zeroes y).
    """
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(chunk_slot_ptr + pid_c)  # with start and end: one round of loads (see the shrink)
    start = tl.load(chunk_start_ptr + pid_c)
    end = tl.load(chunk_end_ptr + pid_c)
    if slot < 0:
        return
    # Which slice this column group belongs to.
    if pid_n < GROUPS0:
        s = 0
        n_lo = pid_n * N_PER_PROG
        out = OUT0
        col0 = 0
        b_ptr = b0_ptr
    elif pid_n < GROUPS0 + GROUPS1:
        s = 1
        n_lo = (pid_n - GROUPS0) * N_PER_PROG
        out = OUT1
        col0 = OUT0
        b_ptr = b1_ptr
    else:
        s = 2
        n_lo = (pid_n - GROUPS0 - GROUPS1) * N_PER_PROG
        out = OUT2
        col0 = OUT0 + OUT1
        b_ptr = b2_ptr
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), tl.minimum(R_MAX, R_PAD))
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    scale = tl.load(sorted_scale_ptr + offs_m, mask=m_mask, other=0.0)
    n_hi = tl.minimum(n_lo + N_PER_PROG, out)
    y_rows = y_ptr + tok[:, None] * stride_yt + col0  # [BLOCK_M, 1]
    if rank == 0:
        if STORE:  # this slot leaves the slice untargeted: its columns of y are 0
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
            for n0 in range(n_lo, n_hi, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                tl.store(y_rows + offs_n[None, :], zeros, mask=m_mask[:, None] & (offs_n < n_hi)[None, :])
        return
    # Out-major B: loads stop at the true rank rounded up to 8 (16 bytes, one vector): B's padding
    # columns past that are never read; the few inside it (odd ranks) share the sector and are
    # zeroed below. Rank-major B: rows past the true rank are simply not loaded.
    offs_r = tl.arange(0, R_BLOCK)
    r_mask = offs_r < rank
    if B_RANK_MAJOR:
        r_load = r_mask
    else:
        r_load = offs_r < (rank + 7) // 8 * 8
    b_slot = b_ptr + slot.to(tl.int64) * out * R_MAX
    if B_RANK_MAJOR:
        b_base = b_slot + offs_r[:, None].to(tl.int64) * out  # [R_BLOCK, 1]
    else:
        b_base = b_slot + offs_r[:, None]
    # The first tile's B (weights, never written by the shrink) and, with Y_EARLY, its y rows are
    # loaded before waiting for the partials.
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    bt = _load_b_tile(b_base, offs_n, n_mask, r_mask, r_load, R_MAX, B_RANK_MAJOR, UPCAST)
    mask = m_mask[:, None] & n_mask[None, :]
    if Y_EARLY:
        cur = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
    else:
        cur = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused
    p = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + s * R_PAD + offs_r[None, :]
    if PDL:  # launched early (programmatic dependent launch): wait for the shrink's partials
        tl.extra.cuda.gdc_wait()
    h = tl.zeros((BLOCK_M, R_BLOCK), dtype=tl.float32)
    for sp in range(0, SPLIT_K):
        h += tl.load(p + sp * stride_ps, mask=m_mask[:, None] & r_load[None, :], other=0.0)
    h = tl.where(r_mask[None, :], h * scale[:, None], 0.0)
    if not UPCAST:
        h = h.to(b0_ptr.dtype.element_ty)

    _write_tile(y_rows + offs_n[None, :], _dot(h, bt, IEEE), mask, cur, Y_EARLY, ATOMIC, STORE)
    for n0 in range(n_lo + BLOCK_N, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        bt = _load_b_tile(b_base, offs_n, n_mask, r_mask, r_load, R_MAX, B_RANK_MAJOR, UPCAST)
        acc = _dot(h, bt, IEEE)
        _write_tile(y_rows + offs_n[None, :], acc, m_mask[:, None] & n_mask[None, :], acc, False, ATOMIC, STORE)


@triton.jit
def _write_tile(y_ptrs, acc, mask, cur, CUR_LOADED: tl.constexpr, ATOMIC: tl.constexpr, STORE: tl.constexpr):
    """One tile of y: `+= acc` (atomic with ATOMIC; cur is y's tile when CUR_LOADED), or `= acc` with STORE."""
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask, sem="relaxed")
    elif STORE:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
    else:
        if not CUR_LOADED:
            cur = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (cur.to(tl.float32) + acc).to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _load_b_tile(b_base, offs_n, n_mask, r_mask, r_load, R_MAX: tl.constexpr, B_RANK_MAJOR: tl.constexpr,
                 UPCAST: tl.constexpr):
    """B's [R_BLOCK, BLOCK_N] tile at columns offs_n: true-rank rows only, padding zeroed."""
    if B_RANK_MAJOR:
        b_ptrs = b_base + offs_n[None, :]
    else:
        b_ptrs = b_base + offs_n[None, :] * R_MAX
    bt = tl.load(b_ptrs, mask=r_load[:, None] & n_mask[None, :], other=0.0)
    if not B_RANK_MAJOR:
        bt = tl.where(r_mask[:, None], bt, 0.0)  # padding may hold anything, even NaN
    if UPCAST:
        bt = bt.to(tl.float32)
    return bt


@triton.jit
def _dot(h, bt, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(h, bt, input_precision="ieee")
    return tl.dot(h, bt)


@dataclass(slots=True)
class LoraLaunch:
    """One projection group's LoRA launches, planned: `launch_shrink` then `launch_expand`.

    The fp32 split-K partials are allocated on the stream that plans, so both launches may run on
    a side stream (beside the base GEMM, `lora_ops.linear_lora_deferred`) once that stream waits
    for the planning one, which waits for the side stream before it frees them.
    """

    x: torch.Tensor
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    ranks_device: torch.Tensor
    meta: LoraMeta
    cfg: LoraKernelConfig
    part: torch.Tensor
    r_max: int
    r_pad: int
    r_blocks: int
    n_slices: int
    b_rank_major: bool
    upcast: bool
    ieee: bool
    pdl: bool
    shrink_zeroes: bool = False  # set by launch_shrink(zero=...): the expand must not read y early


def plan_lora_triton(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks_device: torch.Tensor,
    meta: LoraMeta,
    config: LoraKernelConfig | None = None,
    pdl: bool | None = None,
) -> LoraLaunch | None:
    """Check the inputs and allocate the partials; None when the meta has no chunk to launch for."""
    n_slices = len(lora_a)
    if n_slices > 3:
        raise ValueError(f"at most 3 output slices, got {n_slices}")
    if meta.chunk_slot is None:
        raise ValueError("meta has no chunk list; build it with build_lora_meta")
    num_tokens, in_features = x.shape
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta is for {meta.num_tokens} tokens, x has {num_tokens}")
    if meta.num_chunks > meta.grid_chunks:  # host ints: the chunks past the launch bound would be skipped
        raise ValueError(f"meta has {meta.num_chunks} chunks, but its launches cover {meta.grid_chunks}")
    if meta.grid_chunks == 0:
        return None
    r_max = lora_a[0].shape[1]
    if any(a.shape[1] != r_max for a in lora_a) or r_max == 0:
        raise ValueError("all slices need the same, non-zero r_max")
    if ranks_device is None or tuple(ranks_device.shape) != (n_slices, lora_a[0].shape[0]):
        raise ValueError(f"ranks_device must be [n_slices={n_slices}, S={lora_a[0].shape[0]}] int32")
    if x.stride(1) != 1:
        raise ValueError("x needs unit stride along features")
    lora_a = [a if a.is_contiguous() else a.contiguous() for a in lora_a]
    layouts = {lora_b_layout(b) for b in lora_b}
    if layouts not in ({"rank_major"}, {"out_major"}):  # mixed or odd strides: copy (slow path)
        lora_b = [b.contiguous() for b in lora_b]
        layouts = {"out_major"}
    interp = _interpreting()
    if pdl is None:
        pdl = x.is_cuda and pdl_supported(x.device.index if x.device.index is not None else torch.cuda.current_device())
    cfg = config or pick_config(meta.num_chunks, n_slices, in_features, meta.chunk_size)
    # Rank tiles cover the step's largest true rank (meta.rank_bound), not the pool's r_max.
    r_eff = r_max if meta.rank_bound is None else max(1, min(r_max, meta.rank_bound))
    r_blocks = triton.cdiv(r_eff, BLOCK_R)
    r_pad = r_blocks * BLOCK_R
    num_pairs = num_tokens * meta.token_slots.shape[1]
    part = torch.empty((cfg.split_k, num_pairs, n_slices * r_pad), dtype=torch.float32, device=x.device)
    return LoraLaunch(
        x=x, lora_a=lora_a, lora_b=list(lora_b), ranks_device=ranks_device.to(torch.int32).contiguous(),
        meta=meta, cfg=cfg, part=part, r_max=r_max, r_pad=r_pad, r_blocks=r_blocks, n_slices=n_slices,
        b_rank_major=layouts == {"rank_major"}, upcast=interp or x.dtype == torch.float32,
        ieee=x.dtype == torch.float32 and not interp, pdl=pdl,
    )


def launch_shrink(plan: LoraLaunch, zero: torch.Tensor | None = None) -> None:
    """part[split, pair, s*R_PAD + r] = Σ_k x[token(pair), k] · A_s[slot, r, k] (on the current stream).

    zero: a contiguous buffer the same launch fills with zeros first (the delta `launch_expand`
    will accumulate into), instead of a memset launch before it.
    """
    if zero is not None and not zero.is_contiguous():
        raise ValueError("the buffer to zero must be contiguous")
    x, meta, cfg, a = plan.x, plan.meta, plan.cfg, plan.lora_a
    plan.shrink_zeroes = zero is not None
    in_features = x.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (meta.grid_chunks, cfg.split_k, plan.n_slices * plan.r_blocks)
    if zero is not None and zero.numel() + grid[0] * grid[1] * grid[2] * 1024 >= 2**31:  # int32 offsets
        raise ValueError(f"the buffer to zero is too large for one launch ({zero.numel()} elements)")
    _lora_shrink_kernel[grid](
        x,
        *(a + [a[0]] * (3 - plan.n_slices)),
        plan.ranks_device,
        meta.chunk_slot,
        meta.chunk_start,
        meta.chunk_end,
        meta.sorted_token,
        plan.part,
        plan.part if zero is None else zero,
        in_features,
        k_per_split,
        0 if zero is None else zero.numel(),
        x.stride(0),
        a[0].stride(0),
        a[0].stride(1),
        plan.ranks_device.stride(0),
        plan.part.stride(0),
        plan.part.stride(1),
        R_MAX=plan.r_max,
        R_PAD=plan.r_pad,
        R_BLOCKS=plan.r_blocks,
        BLOCK_M=meta.chunk_size,
        BLOCK_K=cfg.block_k,
        BLOCK_RANK=BLOCK_R,
        UPCAST=plan.upcast,
        IEEE=plan.ieee,
        PDL=plan.pdl,
        ZERO=zero is not None,
        ZERO_BLOCK=1024,
        num_warps=cfg.shrink_warps,
        num_stages=cfg.num_stages,
    )


def launch_expand(plan: LoraLaunch, y: torch.Tensor, store: bool = False) -> None:
    """y[token(pair), slice cols] += scale(pair) · B_s(Σ_splits part), in place (on the current stream).

    store: `=` instead of `+=` (one adapter per token only), so y need not be zeroed first and is
    not read; rows of tokens without an adapter are not written (`LoraMeta.has_lora` tells them).
    """
    _check_shapes(y, plan.x, plan.lora_a, plan.lora_b)
    if y.stride(1) != 1:
        raise ValueError("y needs unit stride along features")
    meta, cfg, b = plan.meta, plan.cfg, plan.lora_b
    atomic = meta.token_slots.shape[1] > 1
    if store and (atomic or plan.shrink_zeroes):
        raise ValueError("a storing expand needs one adapter per token (k = 1) and a shrink that does not zero y")
    outs = [t.shape[1] for t in b] + [0] * (3 - plan.n_slices)
    n_per_prog = max(cfg.n_per_prog, cfg.block_n)
    groups = [triton.cdiv(o, n_per_prog) for o in outs]
    r_pad = plan.r_pad
    _lora_expand_kernel[(meta.grid_chunks, sum(groups))](
        y,
        *(b + [b[0]] * (3 - plan.n_slices)),
        plan.ranks_device,
        meta.chunk_slot,
        meta.chunk_start,
        meta.chunk_end,
        meta.sorted_token,
        meta.sorted_scale,
        plan.part,
        outs[0],
        outs[1],
        outs[2],
        groups[0],
        groups[1],
        cfg.split_k,
        y.stride(0),
        plan.ranks_device.stride(0),
        plan.part.stride(0),
        plan.part.stride(1),
        R_MAX=plan.r_max,
        R_PAD=r_pad,
        R_BLOCK=r_pad if r_pad & (r_pad - 1) == 0 else triton.next_power_of_2(r_pad),
        B_RANK_MAJOR=plan.b_rank_major,
        BLOCK_M=meta.chunk_size,
        BLOCK_N=cfg.block_n,
        N_PER_PROG=n_per_prog,
        UPCAST=plan.upcast,
        IEEE=plan.ieee,
        ATOMIC=atomic,
        PDL=plan.pdl,
        Y_EARLY=not (plan.shrink_zeroes or store or atomic),
        STORE=store,
        num_warps=cfg.expand_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if plan.pdl else {}),
    )


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks_device: torch.Tensor,
    meta: LoraMeta,
    config: LoraKernelConfig | None = None,
    pdl: bool | None = None,
) -> None:
    """y[:, slices] += Σ scale · B(A x), in place: a shrink launch, then an expand launch.

    y: `[T, Σ out_s]`; x: `[T, in]`; lora_a[s]: `[S, r_max, in]`; lora_b[s]: indexed
    `[S, out_s, r_max]`, out-major or rank-major memory (`lora_ops.new_lora_b`); ranks_device:
    `[n_slices, S]` int32 on y's device. Launches even when no token has an adapter (the programs
    exit at once), so a graph captured on any step replays correctly on the next.
    config: launch parameters; default `pick_config` on the host-side meta. Any config accepts any
    meta of the same shapes, so a graph captured with one step's choice replays correctly with
    another step's metadata.
    pdl: launch the expand with programmatic dependent launch (it starts while the shrink runs
    and waits for the partials with `gdc_wait`); None = where supported (`pdl_supported`).
    """
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_device, meta, config, pdl)
    if plan is None:  # nothing to launch; the shapes are still checked (launch_expand does it otherwise)
        _check_shapes(y, x, lora_a, lora_b)
        return
    launch_shrink(plan)
    launch_expand(plan, y)

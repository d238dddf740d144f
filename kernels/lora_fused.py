"""Fused decode LoRA kernel: shrink and expand in one launch, the rank-r intermediate in registers.

Semantics (same as `lora_ops.add_lora_reference`):

    for each chunk c (<= BLOCK_M (token, entry) pairs of one slot, from LoraMeta):
        for each slice s with r = ranks[s, slot] > 0, for each column group g of slice s:
            h = scale(c) * x[tokens(c)] @ A_s[slot, :r].T                  # [rows, r], registers
            y[tokens(c), cols_s(g)] += h @ B_s[slot, cols(g), :r].T        # [rows, |g|]

Grid (max_chunks, Σ_s column groups of slice s, SPLIT_K), fixed by (T, k, max_slots) and the weight
shapes; padding chunks (slot -1) and slices a slot does not target (rank 0) exit at once. One program
reads its chunk's rows of x and the slot's A over its K range at the true rank (masked by
`ranks_device`: rows past it are never loaded), keeps h in registers, then walks its column group in
BLOCK_N tiles: B's true-rank columns times h, added into y. No fp32 round trip through memory, no
second launch, no host sync: a decode step can be captured in a CUDA graph.

Bytes, per program (bf16, rows = pairs in the chunk, r = true rank, K = in_features / SPLIT_K,
N = columns per program):
    shrink: (rows + r) · K · 2        expand: r · N · 2 (B) + rows · N · 4 (y read and written)
Every column group of a chunk recomputes h, so x rows and A are read Σ_s ceil(out_s / N) times per
chunk instead of once; after the first group they come from L2, not HBM. `pick_fused_config` keeps
that factor small: when many chunks are active (the grid is full anyway) N is large, down to one
group per slice, so A is read once per chunk and slice -- exactly the floor; only with few chunks (a
mostly idle GPU) are the columns cut finer, where the extra L2 reads buy parallelism. E.g. q/k/v at
in = 4096, r = 16, 16 rows, one chunk, N = 256: 24 programs each read 256 KiB of x and A (mostly L2)
and 8 KiB of B; at 64 chunks with N = 2048 (4 groups): A is read 4x per chunk from L2, once from HBM.

SPLIT_K > 1 (a config option, not the default) cuts the shrink's K range so one program's serial
load chain stays short for wide inputs such as down_proj (in = 14336: 16 rows + r = 16 read 896 KiB
per program unsplit): each split multiplies its partial h by B and adds into y, since
(Σ_k h_k) B = Σ_k h_k B. It re-reads B SPLIT_K times (from L2) and needs atomic adds into y, each of
which rounds y to bf16 once more, and the order of the adds varies from run to run. k > 1 needs
atomics anyway (two chunks can own the same row); with k = 1 and SPLIT_K = 1 each element of y has
exactly one writer and a plain read-modify-write is race-free and deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorafleet.kernels.lora_ops import LoraMeta

# Few pairs per chunk: LoraMeta's decode chunk size. Prefill-sized chunks (64 rows) re-read too much.
FUSED_MAX_CHUNK_SIZE = 16
# Widest input the fused kernel takes by default: past it one program's unsplit shrink (a serial
# chain over in_features) is likely the critical path, and SPLIT_K would need atomics into y.
FUSED_MAX_IN_FEATURES = 8192


@dataclass(frozen=True, slots=True)
class FusedConfig:
    """Launch parameters of the fused kernel; `pick_fused_config` chooses them per call."""

    split_k: int = 1
    block_k: int = 128
    block_n: int = 128
    n_per_prog: int = 512
    num_warps: int = 4
    num_stages: int = 3


def use_fused(num_chunks: int, in_features: int, n_slices: int, chunk_size: int) -> bool:
    """Dispatch rule: the fused kernel for decode-sized steps, the two-launch path for prefill.

    Decode-sized = LoraMeta cut the step into chunks of at most 16 pairs (<= 512 pairs in all). The
    fused kernel re-reads x and A once per column group, which is cheap for 16-row chunks and not
    for 64-row prefill chunks; the two-launch path reads them once. Past 1024 chunk-slices the grid
    is full with one column group per slice anyway and the two launches' split-K shrink is as good;
    past FUSED_MAX_IN_FEATURES (down_proj) each program's unsplit K loop is too long. Not yet timed
    on the GPU: `bench/kernels.py` prints both paths side by side (and `--sweep` fused configs with
    SPLIT_K) to set this rule.
    """
    return (
        chunk_size <= FUSED_MAX_CHUNK_SIZE
        and num_chunks * n_slices <= 1024
        and in_features <= FUSED_MAX_IN_FEATURES
    )


def pick_fused_config(num_chunks: int, n_slices: int, in_features: int, outs: Sequence[int]) -> FusedConfig:
    """Columns per program from the active chunks; SPLIT_K = 1 (no atomics with k = 1).

    ~132 SMs: with few active chunk-slices, cut the columns finely so more programs run; with many,
    use wide column groups (fewer re-reads of x and A). See the module docstring for the bytes.
    `in_features` is for the sweep's SPLIT_K rule once the GPU numbers say whether it pays.
    """
    del in_features
    work = max(1, num_chunks * n_slices)
    if work <= 4:
        n_per_prog = 256
    elif work <= 32:
        n_per_prog = 512
    elif work <= 128:
        n_per_prog = 1024
    else:
        n_per_prog = 2048
    n_per_prog = min(n_per_prog, triton.next_power_of_2(max(outs)))
    return FusedConfig(split_k=1, n_per_prog=max(n_per_prog, 128), block_n=128)


@triton.jit
def _lora_fused_kernel(
    # pointers
    x_ptr,
    y_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    ranks_ptr,
    chunk_slot_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    sorted_token_ptr,
    sorted_scale_ptr,
    # sizes
    K,
    K_PER_SPLIT,
    OUT0,
    OUT1,
    OUT2,
    GROUPS0,
    GROUPS1,
    # strides
    stride_xt,
    stride_yt,
    stride_as,
    stride_ar,
    stride_rs,
    # meta-parameters
    R_MAX: tl.constexpr,
    R_BLOCK: tl.constexpr,
    B_RANK_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_PER_PROG: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """y[token(pair), col_s + n] += scale(pair) · Σ_r (Σ_k x[token, k] A_s[slot, r, k]) · B_s[slot, n, r].

    x `[T, K]`, A_s `[S, R_MAX, K]` (unit stride in K); y `[T, Σout]` (unit stride in columns);
    B_s indexed `[S, OUT_s, R_MAX]`: rank-major memory (stride 1 along n, OUT_s along r) when
    B_RANK_MAJOR, else contiguous (stride R_MAX along n, 1 along r).
    """
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(chunk_slot_ptr + pid_c)
    if slot < 0:
        return
    if pid_n < GROUPS0:
        s = 0
        n_lo = pid_n * N_PER_PROG
        out = OUT0
        col0 = 0
        a_ptr = a0_ptr
        b_ptr = b0_ptr
    elif pid_n < GROUPS0 + GROUPS1:
        s = 1
        n_lo = (pid_n - GROUPS0) * N_PER_PROG
        out = OUT1
        col0 = OUT0
        a_ptr = a1_ptr
        b_ptr = b1_ptr
    else:
        s = 2
        n_lo = (pid_n - GROUPS0 - GROUPS1) * N_PER_PROG
        out = OUT2
        col0 = OUT0 + OUT1
        a_ptr = a2_ptr
        b_ptr = b2_ptr
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R_MAX)
    if rank == 0:
        return
    start = tl.load(chunk_start_ptr + pid_c)
    end = tl.load(chunk_end_ptr + pid_c)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    scale = tl.load(sorted_scale_ptr + offs_m, mask=m_mask, other=0.0)
    offs_r = tl.arange(0, R_BLOCK)
    r_mask = offs_r < rank

    # Shrink over this program's K range; A rows past the true rank are never loaded.
    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar  # [1, R_BLOCK]
    h = tl.zeros((BLOCK_M, R_BLOCK), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    if k_lo >= K:  # an empty split (small inputs): nothing to add
        return
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
            h += tl.dot(xt, at, input_precision="ieee")
        else:
            h += tl.dot(xt, at)
    h = h * scale[:, None]
    if not UPCAST:
        h = h.to(b0_ptr.dtype.element_ty)

    # Expand: B's true-rank columns (masked loads, so the pool's padding -- even NaN -- is never read).
    n_hi = tl.minimum(n_lo + N_PER_PROG, out)
    b_slot = b_ptr + slot.to(tl.int64) * out * R_MAX
    if B_RANK_MAJOR:
        # A slot's rows are contiguous along n: the rank mask is constant along the vectors.
        b_base = b_slot + offs_r[:, None].to(tl.int64) * out  # [R_BLOCK, 1]
        r_load = r_mask
    else:
        # Along r: load up to the rank rounded to 8 (16 bytes, one vector; the padding columns
        # inside it share the sector), then zero those columns, which may hold anything, even NaN.
        b_base = b_slot + offs_r[:, None]
        r_load = offs_r < (rank + 7) // 8 * 8
    y_rows = y_ptr + tok[:, None] * stride_yt + col0  # [BLOCK_M, 1]
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        if B_RANK_MAJOR:
            b_ptrs = b_base + offs_n[None, :]
        else:
            b_ptrs = b_base + offs_n[None, :] * R_MAX
        bt = tl.load(b_ptrs, mask=r_load[:, None] & n_mask[None, :], other=0.0)
        if not B_RANK_MAJOR:
            bt = tl.where(r_mask[:, None], bt, 0.0)
        if UPCAST:
            bt = bt.to(tl.float32)
        if IEEE:
            acc = tl.dot(h, bt, input_precision="ieee")
        else:
            acc = tl.dot(h, bt)
        y_ptrs = y_rows + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask, sem="relaxed")
        else:
            cur = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (cur.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def launch_fused(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks_device: torch.Tensor,
    meta: LoraMeta,
    b_rank_major: bool,
    upcast: bool,
    ieee: bool,
    config: FusedConfig | None = None,
) -> None:
    """One launch for all slices. Arguments checked by `triton_lora.add_lora_triton`: A contiguous,
    every B in the layout `b_rank_major` names, ranks_device `[n_slices, S]` int32 contiguous."""
    n_slices = len(lora_a)
    in_features = x.shape[1]
    k = meta.token_slots.shape[1]
    outs = [b.shape[1] for b in lora_b] + [0] * (3 - n_slices)
    cfg = config or pick_fused_config(meta.num_chunks, n_slices, in_features, outs[:n_slices])
    n_per_prog = max(cfg.n_per_prog, cfg.block_n)
    groups = [triton.cdiv(o, n_per_prog) for o in outs]
    k_per_split = triton.cdiv(triton.cdiv(in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    r_max = lora_a[0].shape[1]
    a_ptrs = list(lora_a) + [lora_a[0]] * (3 - n_slices)
    b_ptrs = list(lora_b) + [lora_b[0]] * (3 - n_slices)
    _lora_fused_kernel[(meta.max_chunks, sum(groups), cfg.split_k)](
        x,
        y,
        *a_ptrs,
        *b_ptrs,
        ranks_device,
        meta.chunk_slot,
        meta.chunk_start,
        meta.chunk_end,
        meta.sorted_token,
        meta.sorted_scale,
        in_features,
        k_per_split,
        outs[0],
        outs[1],
        outs[2],
        groups[0],
        groups[1],
        x.stride(0),
        y.stride(0),
        lora_a[0].stride(0),
        lora_a[0].stride(1),
        ranks_device.stride(0),
        R_MAX=r_max,
        R_BLOCK=max(16, triton.next_power_of_2(r_max)),
        B_RANK_MAJOR=b_rank_major,
        BLOCK_M=meta.chunk_size,
        BLOCK_K=cfg.block_k,
        BLOCK_N=cfg.block_n,
        N_PER_PROG=n_per_prog,
        UPCAST=upcast,
        IEEE=ieee,
        ATOMIC=k > 1 or cfg.split_k > 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )

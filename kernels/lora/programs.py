"""The Triton programs of the multi-LoRA side path: the segmented shrink and expand.

What they compute, how their grids are laid out and how they are launched (programmatic dependent
launch, the storing expand, rank tiles bounded per step) is in `lorafleet.kernels.lora.launch`, the
host side that plans and launches them; this module holds only the `@triton.jit` functions, so the
two can be read (and compile-checked, `tests/kernels/test_lora_kernels.py`) apart.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    ROWS: tl.constexpr,
    META_ROUND: tl.constexpr,
):
    """part[split, pair, s*R_PAD + r] = Σ_{k in split} x[token(pair), k] · A_s[slot, r, k].

    x `[T, K]` (unit stride in K); A_s `[S, R_MAX, K]` (unit stride in K); part fp32.
    ZERO: first, every program (padding ones too) zeroes its share of the contiguous buffer at
    zero_ptr (ZERO_NUMEL elements): the expand's output when it accumulates into a fresh delta,
    which then needs no memset launch of its own.
    ROWS: each row of the chunk as its own multiply-and-sum in registers (BLOCK_RANK x BLOCK_K
    products summed over K), no `tl.dot` and no shared-memory staging: for chunks of about one row
    (decode with as many adapters as tokens), where a BLOCK_M-row `tl.dot` tile is mostly padding.
    Each further row re-reads the A tile (from L1/L2).
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
    if _chunk_skipped(slot, start, end, META_ROUND):
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
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if ROWS:
        a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar  # [BLOCK_RANK, 1]
        p_rows = part_ptr + pid_k * stride_ps + start.to(tl.int64) * stride_pm + s * R_PAD + offs_r
        for m in range(start, end):
            x_row = x_ptr + tl.load(sorted_token_ptr + m).to(tl.int64) * stride_xt
            row = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < k_hi
                at = tl.load(a_cols + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
                row += tl.sum(at.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
            # Written even when this split's K range is empty, as below.
            tl.store(p_rows + (m - start) * stride_pm, row, mask=r_mask)
    else:  # (not after a return: the tl.dot path must not be compiled with ROWS' rank tiles below 16)
        x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar  # [1, BLOCK_RANK]

        acc = tl.zeros((BLOCK_M, BLOCK_RANK), dtype=tl.float32)
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
    ROWS: tl.constexpr,
    AHEAD: tl.constexpr,
    SPLIT_SUM: tl.constexpr,
    META_ROUND: tl.constexpr,
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
    SPLIT_SUM: how the K splits' partials are summed after the wait (`_sum_splits`): 0 a split a
    loop iteration; n > 0 all n (= SPLIT_K) unrolled, their loads in one round.
    AHEAD (N_PER_PROG > BLOCK_N): each tile after the first is loaded (B, and y for a plain `+=`)
    before the previous tile is multiplied and written (its B and y loads issued together; the
    last iteration's loads past the group are masked off); for launches of few programs, where each
    program's load latency sets the time.
    ROWS (N_PER_PROG == BLOCK_N: one B tile a program): each row of the chunk as its own
    multiply-and-sum in registers (B tile × the row's rank-r activations, summed over r), no
    `tl.dot`: for chunks of about one row (decode with as many adapters as tokens), where a
    BLOCK_M-row tile is mostly padding. Each thread then holds whole rank columns of B; at 8 columns
    a thread (BLOCK_N = 256 · warps) its loads are 16-byte vectors; only such configs beat the
    `tl.dot` mode (docs/benchmarks.md, "LoRA kernel tuning").
    """
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(chunk_slot_ptr + pid_c)  # with start and end: one round of loads (see the shrink)
    start = tl.load(chunk_start_ptr + pid_c)
    end = tl.load(chunk_end_ptr + pid_c)
    if _chunk_skipped(slot, start, end, META_ROUND):
        if PDL:  # even with nothing to do: the kernel must not complete before the shrink has
            tl.extra.cuda.gdc_wait()
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
        if PDL:  # as above: the kernels behind this one may take its completion for the shrink's
            tl.extra.cuda.gdc_wait()
        return
    # Out-major B: loads stop at the true rank rounded up to 8 (16 bytes, one vector): B's padding
    # columns past that are never read; the few inside it (odd ranks) share the sector and are
    # zeroed below. Rank-major B: rows past the true rank are simply not loaded.
    offs_r = tl.arange(0, R_BLOCK)
    r_mask = offs_r < rank
    if B_RANK_MAJOR:
        r_load = r_mask
    else:
        r_load = offs_r < tl.minimum((rank + 7) // 8 * 8, R_MAX)  # within B's row: the last slot's ends B
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
    if ROWS:
        _expand_rows(y_ptr + col0 + offs_n, bt.to(tl.float32), n_mask, part_ptr + s * R_PAD + offs_r, r_mask,
                     r_load, offs_m, tok, scale, start, end, SPLIT_K, stride_yt, stride_ps, stride_pm, ATOMIC, PDL,
                     Y_EARLY, STORE, SPLIT_SUM)
    else:  # (not after a return: the tl.dot path must not be compiled with ROWS' rank tiles below 16)
        mask = m_mask[:, None] & n_mask[None, :]
        if Y_EARLY:
            cur = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
        else:
            cur = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused
        p = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + s * R_PAD + offs_r[None, :]
        if PDL:  # launched early (programmatic dependent launch): wait for the shrink's partials
            tl.extra.cuda.gdc_wait()
        h = _sum_splits(p, m_mask[:, None] & r_load[None, :], SPLIT_K, stride_ps, SPLIT_SUM)
        h = tl.where(r_mask[None, :], h * scale[:, None], 0.0)
        if not UPCAST:
            h = h.to(b0_ptr.dtype.element_ty)

        _write_tile(y_rows + offs_n[None, :], _dot(h, bt, IEEE), mask, cur, Y_EARLY, ATOMIC, STORE)
        if AHEAD and N_PER_PROG > BLOCK_N:  # tile i+1's B and y loaded before tile i's multiply and store
            offs_n = n_lo + BLOCK_N + tl.arange(0, BLOCK_N)
            mask = m_mask[:, None] & (offs_n < n_hi)[None, :]
            bt = _load_b_tile(b_base, offs_n, offs_n < n_hi, r_mask, r_load, R_MAX, B_RANK_MAJOR, UPCAST)
            y_cur = _load_y_ahead(y_rows + offs_n[None, :], mask, ATOMIC, STORE)
            for n0 in range(n_lo + BLOCK_N, n_hi, BLOCK_N):
                offs_next = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
                mask_next = m_mask[:, None] & (offs_next < n_hi)[None, :]
                bt_next = _load_b_tile(b_base, offs_next, offs_next < n_hi, r_mask, r_load, R_MAX, B_RANK_MAJOR,
                                       UPCAST)
                y_next = _load_y_ahead(y_rows + offs_next[None, :], mask_next, ATOMIC, STORE)
                _write_tile(y_rows + offs_n[None, :], _dot(h, bt, IEEE), mask, y_cur, not (ATOMIC or STORE),
                            ATOMIC, STORE)
                offs_n, mask, bt, y_cur = offs_next, mask_next, bt_next, y_next
        else:
            for n0 in range(n_lo + BLOCK_N, n_hi, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < n_hi
                bt = _load_b_tile(b_base, offs_n, n_mask, r_mask, r_load, R_MAX, B_RANK_MAJOR, UPCAST)
                acc = _dot(h, bt, IEEE)
                _write_tile(y_rows + offs_n[None, :], acc, m_mask[:, None] & n_mask[None, :], acc, False, ATOMIC, STORE)


@triton.jit
def _expand_rows(y_cols, bt, n_mask, p_cols, r_mask, r_load, offs_m, tok, scale, start, end, SPLIT_K,
                 stride_yt, stride_ps, stride_pm, ATOMIC: tl.constexpr, PDL: tl.constexpr, Y_EARLY: tl.constexpr,
                 STORE: tl.constexpr, SPLIT_SUM: tl.constexpr):
    """The expand's ROWS mode, from its B tile on: y[token(m), cols] (+)= scale(m) · Σ_r h_m[r] · bt[r, :]
    for each pair m of the chunk. bt `[R_BLOCK, BLOCK_N]` fp32 (zero past the true rank); tok and
    scale are the chunk's `[BLOCK_M]` vectors (offs_m: their pairs), picked a row at a time in
    registers. With Y_EARLY the first row's y is loaded before `gdc_wait`."""
    if Y_EARLY:
        tok0 = tl.sum(tl.where(offs_m == start, tok, 0))
        cur0 = tl.load(y_cols + tok0 * stride_yt, mask=n_mask, other=0.0).to(tl.float32)
    if PDL:  # launched early (programmatic dependent launch): wait for the shrink's partials
        tl.extra.cuda.gdc_wait()
    p_cols += start.to(tl.int64) * stride_pm
    for m in range(start, end):
        h = tl.sum(_sum_splits((p_cols + (m - start) * stride_pm)[None, :], r_load[None, :], SPLIT_K, stride_ps,
                               SPLIT_SUM), axis=0)
        h = tl.where(r_mask, h * tl.sum(tl.where(offs_m == m, scale, 0.0)), 0.0)
        acc = tl.sum(bt * h[:, None], axis=0)
        y_row = y_cols + tl.sum(tl.where(offs_m == m, tok, 0)) * stride_yt
        if ATOMIC:
            tl.atomic_add(y_row, acc.to(y_row.dtype.element_ty), mask=n_mask, sem="relaxed")
        elif STORE:
            tl.store(y_row, acc.to(y_row.dtype.element_ty), mask=n_mask)
        else:
            if Y_EARLY:
                if m == start:
                    cur = cur0
                else:
                    cur = tl.load(y_row, mask=n_mask, other=0.0).to(tl.float32)
            else:
                cur = tl.load(y_row, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_row, (cur + acc).to(y_row.dtype.element_ty), mask=n_mask)


@triton.jit
def _chunk_skipped(slot, start, end, META_ROUND: tl.constexpr):
    """Whether a program's chunk has nothing to do: a padding chunk (slot -1). META_ROUND: an empty
    range counts too (never the case in a real chunk), so the branch needs start and end as well and
    the compiler cannot sink their loads below it: all three go out in one round, where otherwise
    start and end are loaded only after the slot has come back."""
    if META_ROUND:
        return (slot < 0) | (end <= start)
    return slot < 0


@triton.jit
def _sum_splits(p, mask, SPLIT_K, stride_ps, SPLIT_SUM: tl.constexpr):
    """Σ_sp part at p + sp·stride_ps over the SPLIT_K splits (p: a 2-D block of pointers), masked.
    SPLIT_SUM 0: a split a loop iteration (the loop is not software-pipelined: ptxas unrolls it by 4
    and issues each group's loads after the previous group's adds, a round of L2 latency a group);
    n > 0 (n == SPLIT_K): unrolled, every split's loads independent in straight-line code, which
    ptxas issues back to back."""
    if SPLIT_SUM > 0:
        h = tl.load(p, mask=mask, other=0.0)
        for sp in tl.static_range(1, SPLIT_SUM):
            h += tl.load(p + sp * stride_ps, mask=mask, other=0.0)
    else:
        h = tl.zeros(p.shape, dtype=tl.float32)
        for sp in range(0, SPLIT_K):
            h += tl.load(p + sp * stride_ps, mask=mask, other=0.0)
    return h


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
def _load_y_ahead(y_ptrs, mask, ATOMIC: tl.constexpr, STORE: tl.constexpr):
    """y's tile for a plain `+=` (`_write_tile` with CUR_LOADED), loaded ahead of the multiply;
    with ATOMIC or STORE nothing is read (a placeholder of the tile's shape)."""
    if ATOMIC or STORE:
        cur = tl.zeros(mask.shape, dtype=y_ptrs.dtype.element_ty)
    else:
        cur = tl.load(y_ptrs, mask=mask, other=0.0)
    return cur


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

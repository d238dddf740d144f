"""Paged decode attention in Triton: one new query token per sequence over its block-table KV cache.

Semantics (same as `paged_decode_attention_reference`):

    for b in range(B):
        n = context_lens[b]                                # 0 (a padding row) gives zeros
        lo = max(0, n - window) if window else 0           # a sliding window: the last `window` tokens
        blocks = block_tables[b, : cdiv(n, block_size)]
        K = k_cache[blocks].flatten(0, 1)[lo:n]            # [n - lo, KVH, D]
        V = v_cache[blocks].flatten(0, 1)[lo:n]
        for h in range(H):
            kvh = h // (H // KVH)                          # GQA: a group of query heads per KV head
            s = scale * K[:, kvh] @ q[b, h]                # [n - lo]
            if softcap: s = softcap * tanh(s / softcap)    # Gemma 2's attention soft-capping
            p = softmax(s)                                 # in fp32
            out[b, h] = p @ V[:, kvh]                      # [D]

Two launches (flash-decoding):
- attend: grid (B, KVH, NUM_SPLITS). A program takes one sequence, one KV head and all the query
  heads of its group (padded to 16 rows for `tl.dot`), so each K/V tile is read once per group. A
  sequence's context is cut into BLOCK_N-token tiles and the tiles are shared out evenly between
  its NUM_SPLITS programs *at run time*, from the context length read on the device (a window's
  tiles start at its first token's, so a windowed layer reads only the window): a short
  context keeps a few programs busy and the rest exit at once, a long one uses them all. Each
  program runs an online softmax over its tiles with fp32 accumulation; a tile gathers its tokens
  through the block table, so block tables need not be contiguous and a tile may span blocks.
- reduce: grid (B, H), only when NUM_SPLITS > 1. Merges the splits' (max, sum, acc) partials.

Grid and buffer shapes depend only on (B, H, KVH, D, max_blocks) and the launch config, never on
the step's context lengths, and nothing syncs with the host: a decode step can be captured once in
a CUDA graph and replayed with new block tables and context lengths written into the same tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorafleet.kernels import pdl
from lorafleet.kernels.envs import interpreting

MIN_DOT = 16  # tl.dot's smallest M, N and K
MAX_SPLITS = 32
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the `window` argument of a layer without one: longer than any context


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters; `pick_config` chooses them per shape (a captured graph keeps its own)."""

    block_n: int  # context tokens per tile
    num_splits: int  # programs per (sequence, KV head); a power of two
    num_warps: int = 4
    num_stages: int = 2


def pick_config(
    batch: int, kv_heads: int, max_blocks: int, block_size: int, head_dim: int, device: torch.device
) -> DecodeConfig:
    """Split the context only as far as it takes to give every SM a few programs: B × KVH programs
    are enough at batch 64 (512 on an H200's 132 SMs), a single sequence needs up to 32 splits. Uses
    the block-table width, not the context lengths, so the choice is the same on every step.
    Starting point; `bench/attention.py --sweep` times the alternatives on the GPU."""
    block_n = 64 if head_dim <= 128 else 32
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    max_tiles = triton.cdiv(max_blocks * block_size, block_n)
    wanted = triton.cdiv(2 * sms, batch * kv_heads)
    num_splits = min(triton.next_power_of_2(wanted), triton.next_power_of_2(max_tiles), MAX_SPLITS)
    return DecodeConfig(block_n=block_n, num_splits=max(1, num_splits))


@triton.jit
def _paged_decode_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    # sizes
    num_heads,
    qk_scale,  # softmax scale × log2(e): the kernel works in base 2
    window,  # sliding window in tokens; NO_WINDOW: the whole context
    cap_in,  # SOFTCAP: scale / softcap, so q·k × cap_in = scores / softcap
    cap_out,  # SOFTCAP: softcap × log2(e): the capped scores in base 2
    # strides
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Attend one (sequence, KV head, split).

    q `[B, H, D]` (unit stride in D); k/v cache `[num_blocks, block_size, KVH, D]` (unit stride in
    D); block_tables `[B, max_blocks]` int32 (unit stride in blocks); context_lens `[B]` int32.
    NUM_SPLITS == 1: out `[B, H, D]`. Otherwise fp32 partials in base 2: part_m, part_l
    `[B, H, NUM_SPLITS]` (running max, sum of exponentials) and part_acc `[B, H, NUM_SPLITS, D]`
    (unnormalised output); a split with no tiles writes (-inf, 0, 0).
    """
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_s = tl.program_id(2)

    # Share the sequence's tiles evenly between its splits, from the length on the device.
    ctx = tl.load(context_lens_ptr + pid_b)
    lo = tl.maximum(ctx - window, 0)  # the window's first token
    first_tile = lo // BLOCK_N
    num_tiles = tl.cdiv(ctx, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_lo = first_tile + pid_s * per_split
    t_hi = tl.minimum(t_lo + per_split, first_tile + num_tiles)

    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < GROUP
    heads = pid_kvh * GROUP + offs_g  # [G_PAD] query heads of this KV head
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G_PAD, D_PAD]; padding rows are zero and never stored
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + pid_b.to(tl.int64) * stride_tb
    k_head = k_cache_ptr + pid_kvh * stride_kh
    v_head = v_cache_ptr + pid_kvh * stride_vh
    for t in range(t_lo, t_hi):
        tok = t * BLOCK_N + offs_n  # [BLOCK_N] positions in the sequence
        valid = (tok < ctx) & (tok >= lo)
        # Masked: table entries past the context may be stale, and cache slots past it hold anything.
        block = tl.load(table + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = tok % BLOCK_SIZE
        kv_mask = valid[None, :] & d_mask[:, None]
        k = tl.load(
            k_head + block[None, :] * stride_kb + in_block[None, :] * stride_kt + offs_d[:, None],
            mask=kv_mask,
            other=0.0,
        )  # [D_PAD, BLOCK_N], loaded transposed for the dot
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFTCAP:  # softcap · tanh(scores / softcap), tanh(x) = 1 - 2 / (e^2x + 1): saturates without overflow
            s = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * (s * cap_in)) + 1.0))
        else:
            s = s * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))  # [G_PAD, BLOCK_N]
        # Every tile holds at least one valid token, so m_new is finite and exp2 never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + block[:, None] * stride_vb + in_block[:, None] * stride_vt + offs_d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, D_PAD]
        if UPCAST:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)  # the tensor cores take 16-bit operands (flash attention does the same)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    if NUM_SPLITS == 1:
        # A padding row (context 0) has l = 0 and acc = 0: write zeros, not 0/0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (pid_b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + pid_s  # [G_PAD]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(
            part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :]
        )


@triton.jit
def _reduce_splits_kernel(
    # pointers
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    # sizes
    num_heads,
    # strides
    stride_ob,
    stride_oh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[b, h] = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) l_s with M = max_s m_s; partials as above."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    row = (pid_b.to(tl.int64) * num_heads + pid_h) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    m_s = tl.load(part_m_ptr + row + offs_s)  # [NUM_SPLITS]
    l_s = tl.load(part_l_ptr + row + offs_s)
    acc = tl.load(part_acc_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: a padding row
    w = tl.exp2(m_s - m_max)  # empty splits: 2^-inf = 0
    denom = tl.sum(l_s * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + pid_h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache -> out `[B, H, D]` in q's dtype.

    window: each sequence attends to its last `window` tokens only (None: all of them); softcap:
    scores soft-capped as Gemma 2's (None: not). Both are fixed per launch (per layer), so a
    captured graph keeps them.

    q: `[B, H, D]`; k_cache, v_cache: `[num_blocks, block_size, KVH, D]` (H a multiple of KVH);
    block_tables: `[B, max_blocks]` int32; context_lens: `[B]` int32, each in 0..max_blocks·block_size
    (not checked: that would sync with the device); a row with context 0 gives zeros (padding rows of
    a CUDA-graph batch bucket). `out`, if given, is written in place (a graph's static output).
    """
    # (1) check shapes
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, H, D] and the caches [blocks, block_size, KVH, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    batch, heads, head_dim = q.shape
    _num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, the cache {cache_dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks] int32, got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if tuple(context_lens.shape) != (batch,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be [B={batch}] int32, got {tuple(context_lens.shape)} {context_lens.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    tensors = (k_cache, v_cache, block_tables, context_lens)
    if any(t.device != q.device for t in tensors):
        raise ValueError("q, the caches, block_tables and context_lens must be on one device")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables need unit stride in their last dimension")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or out.stride(2) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with unit stride in D")
    cfg = config or pick_config(batch, kv_heads, block_tables.shape[1], block_size, head_dim, q.device)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if cfg.block_n < MIN_DOT or cfg.block_n & (cfg.block_n - 1) or cfg.num_splits & (cfg.num_splits - 1):
        raise ValueError(f"block_n must be a power of two >= {MIN_DOT} and num_splits a power of two: {cfg}")

    # (2) allocate
    if out is None:
        out = torch.empty_like(q)
    group = heads // kv_heads
    d_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    if cfg.num_splits > 1:
        part_m = torch.empty((batch, heads, cfg.num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, heads, cfg.num_splits, head_dim), dtype=torch.float32, device=q.device)
    else:  # not read: the kernel writes `out` directly
        part_m = part_l = part_acc = out

    # (3) launch
    interp = interpreting()
    _paged_decode_kernel[(batch, kv_heads, cfg.num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
        heads,
        scale * LOG2E,
        window or NO_WINDOW,
        scale / softcap if softcap else 1.0,
        softcap * LOG2E if softcap else 1.0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP=group,
        G_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=cfg.num_splits,
        # The interpreter's dot wants fp32; fp32 on the GPU asks for IEEE, not TF32.
        UPCAST=interp or q.dtype == torch.float32,
        IEEE=q.dtype == torch.float32 and not interp,
        SOFTCAP=softcap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_kwargs(use_pdl := pdl.row_kernel_pdl("attention", q)),
    )
    if cfg.num_splits > 1:
        _reduce_splits_kernel[(batch, heads)](
            part_m,
            part_l,
            part_acc,
            out,
            heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=cfg.num_splits,
            num_warps=4,
            **pdl.launch_kwargs(use_pdl),
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The oracle: a per-sequence loop in fp32, shapes as `paged_decode_attention`; out in q's dtype."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        blocks = block_tables[b, : math.ceil(n / block_size)].long()
        lo = max(0, n - window) if window else 0
        k = k_cache[blocks].flatten(0, 1)[lo:n].float().repeat_interleave(heads // kv_heads, dim=1)  # [n - lo, H, D]
        v = v_cache[blocks].flatten(0, 1)[lo:n].float().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        p = torch.softmax(s, dim=-1)  # [H, n - lo]
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(q.dtype)

"""Fused RoPE and KV-cache write of the decoder layer in Triton: one launch where torch takes 12.

The torch path rotates q and k (5 ops each: mul, neg, cat, mul, add) and writes K and V with an
`index_copy_` each; `rope_write_kv` rotates q in place and stores the rotated k and v straight into
their cache slots. Why fuse, the LoRA `delta` and CUDA graphs: `kernels/layers/fused_delta.py`. Padding
rows of a graph's batch bucket carry the *sink* slot (a KV block never handed out) and are written
there like any other row.

Semantics (same as `rope_write_kv_reference`, the oracle; math in fp32, one rounding to the
activation dtype wherever the torch path of `worker/models/llama.py` rounds):

    rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, delta=None):
        qkv' = qkv + delta                              # if given, rounded (qkv keeps its k, v)
        q, k, v = qkv.split([H·D, KVH·D, KVH·D], -1)   # heads of D; q rotated in place
        c, s = cos_sin[positions, :D/2], cos_sin[positions, D/2:]
        rot(x) = cat(x1·c - x2·s, x2·c + x1·s)          # x1, x2 = halves of each head (rotate-half)
        q[:] = rot(q); cache_k[slot_mapping] = rot(k); cache_v[slot_mapping] = v
        return q.view(T, H, D)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels import pdl
from lorafleet.kernels.layers.fused_delta import (
    FLOAT_DTYPES,
    check_delta,
    delta_defined,
    load_plus,
    masked_delta,
    row_warps,
)


@triton.jit
def _rotate_heads(
    src,
    delta,
    dst,
    dst_stride_h,
    num_heads,
    cos,
    sin,
    offs_d,
    d_mask,
    use_delta,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
):
    """Rotate `num_heads` contiguous heads of one token at `src` (+ `delta`, laid out alike, where
    use_delta) and store them at `dst` (may be src).

    cos, sin: `[1, HALF_PAD]` fp32; a head's halves are x[:HALF] and x[HALF:].
    """
    offs_h = tl.arange(0, H_PAD)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    offs = offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # [H_PAD, HALF_PAD]
    x1 = load_plus(src + offs, delta + offs, mask, use_delta, HAS_DELTA)
    x2 = load_plus(src + offs + HALF, delta + offs + HALF, mask, use_delta, HAS_DELTA)
    d = dst + offs_h[:, None] * dst_stride_h + offs_d[None, :]
    tl.store(d, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(d + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    # pointers
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    k_cache_ptr,
    v_cache_ptr,
    delta_ptr,
    rows_ptr,
    # sizes
    num_heads,
    num_kv_heads,
    # strides
    stride_qkv,
    stride_d,
    stride_cs,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    # meta-parameters
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    H_PAD: tl.constexpr,
    KVH_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token per program, all its heads at once.

    qkv `[T, (H + 2·KVH)·D]` (unit stride in features), positions and slot_mapping `[T]`,
    cos_sin `[P, D]` fp32 (cos | sin of each rotary pair), caches `[blocks, BLOCK_SIZE, KVH, D]`
    (unit stride in D), D = 2·HALF.
    """
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    table = cos_sin_ptr + pos * stride_cs
    cos = tl.load(table + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(table + HALF + offs_d, mask=d_mask, other=0.0)[None, :]

    q = qkv_ptr + t * stride_qkv
    dq = delta_ptr + t * stride_d
    use = delta_defined(rows_ptr, t, HAS_ROWS)
    _rotate_heads(q, dq, q, 2 * HALF, num_heads, cos, sin, offs_d, d_mask, use, HALF, H_PAD, HAS_DELTA)

    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    k = q + num_heads * (2 * HALF)
    dk = dq + num_heads * (2 * HALF)
    k_dst = k_cache_ptr + block * stride_kb + in_block * stride_ks
    _rotate_heads(k, dk, k_dst, stride_kh, num_kv_heads, cos, sin, offs_d, d_mask, use, HALF, KVH_PAD, HAS_DELTA)

    offs_h = tl.arange(0, KVH_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & d_mask[None, :]
    v_offs = num_kv_heads * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vb + in_block * stride_vs + offs_h[:, None] * stride_vh + offs_d[None, :]
    for half in tl.static_range(2):
        x = load_plus(k + v_offs + half * HALF, dk + v_offs + half * HALF, mask, use, HAS_DELTA)
        tl.store(v_dst + half * HALF, x.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_rope_inputs(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int, int]:
    """-> (heads, kv_heads, head_dim), read off the cache and qkv's width."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"the caches must be [blocks, block_size, KVH, D] alike, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if qkv.dim() != 2 or head_dim % 2 or (qkv.shape[1] - 2 * kv_heads * head_dim) % head_dim:
        raise ValueError(f"qkv must be [T, (H + 2·{kv_heads})·{head_dim}] with an even head_dim, got {tuple(qkv.shape)}")
    heads = (qkv.shape[1] - 2 * kv_heads * head_dim) // head_dim
    if heads < 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} leaves no query heads beside {kv_heads} KV heads of {head_dim}")
    tokens = qkv.shape[0]
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"positions and slot_mapping must be [{tokens}], got {tuple(positions.shape)}, "
                         f"{tuple(slot_mapping.shape)}")
    if positions.is_floating_point() or slot_mapping.is_floating_point():
        raise ValueError("positions and slot_mapping must be integer tensors")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be [positions, {head_dim}] float32, got {tuple(cos_sin_cache.shape)} "
                         f"{cos_sin_cache.dtype}")
    if qkv.dtype not in FLOAT_DTYPES or k_cache.dtype not in FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"qkv ({qkv.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must be float16, "
                         "bfloat16 or float32, the caches alike")
    tensors = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if any(t.device != qkv.device for t in tensors):
        raise ValueError("qkv, positions, cos_sin_cache, the caches and slot_mapping must be on one device")
    if qkv.stride(1) != 1 or cos_sin_cache.stride(1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("qkv, cos_sin_cache and the caches need unit stride in their last dimension")
    return heads, kv_heads, head_dim


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q in place, rotate k, store k and v at their cache slots -> q `[T, H, D]` (a view of qkv).

    qkv: `[T, (H + 2·KVH)·D]`, the fused projection's output; positions, slot_mapping: `[T]` int
    (slots not checked: that would sync; each must name a slot of the cache, the sink included);
    cos_sin_cache: `[P, D]` float32, cos then sin of each rotary pair (`Rotary.cos_sin`), positions
    below P; k_cache, v_cache: `[num_blocks, block_size, KVH, D]`; delta: None or like qkv,
    added first (q, k and v are those of qkv + delta; qkv's k and v columns are left as they are);
    delta_rows: `[T]` int, the rows whose delta is defined (None: all).
    """
    heads, kv_heads, head_dim = _check_rope_inputs(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    rows = check_delta(delta, qkv, "qkv", delta_rows)
    half = head_dim // 2
    dlt = qkv if delta is None else delta  # not read without HAS_DELTA
    _rope_write_kv_kernel[(qkv.shape[0],)](
        qkv,
        positions,
        cos_sin_cache,
        slot_mapping,
        k_cache,
        v_cache,
        dlt,
        qkv if rows is None else rows,  # not read without HAS_ROWS
        heads,
        kv_heads,
        qkv.stride(0),
        dlt.stride(0),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        H_PAD=triton.next_power_of_2(heads),
        KVH_PAD=triton.next_power_of_2(kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
        HAS_DELTA=delta is not None,
        HAS_ROWS=rows is not None,
        num_warps=row_warps(triton.next_power_of_2(heads) * triton.next_power_of_2(half)),
        **pdl.launch_kwargs(pdl.row_kernel_pdl("rope_write_kv", qkv, delta is not None)),
    )
    return qkv[:, : heads * head_dim].unflatten(1, (heads, head_dim))


def rope_write_kv_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    delta = masked_delta(delta, delta_rows)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads = qkv.shape[1] // head_dim - 2 * kv_heads
    src = qkv if delta is None else qkv + delta
    q, k, v = src.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    out_q = qkv[:, : heads * head_dim].unflatten(1, (heads, head_dim))
    out_q.copy_(rotate(q.unflatten(1, (heads, head_dim))))
    slots = slot_mapping.long()
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, rotate(k.unflatten(1, (kv_heads, head_dim))).to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.unflatten(1, (kv_heads, head_dim)).to(v_cache.dtype))
    return out_q

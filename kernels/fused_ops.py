"""Fused elementwise ops of the decoder layer in Triton: one launch each where torch takes several.

A decode step is launch-bound: at batch 64 on the seed shape a step replayed from a CUDA graph
launches ~1,550 kernels, most of them tiny elementwise torch ops at ~2 µs each even in a graph.
Counted per layer in bf16 (aten ops under a dispatch mode), the torch path launches 32 besides
the 4 matmuls and attention: two RMSNorms (8 each: float, pow, mean, add, rsqrt, mul, cast, mul),
two residual adds, RoPE on q and k (5 each: mul, neg, cat, mul, add), two K/V `index_copy_`, SiLU
and the product. With these ops a layer takes 4: `rope_write_kv`, `silu_mul` and two
`add_rms_norm` (each residual add fused into the norm after it), plus one plain `rms_norm` per step.

Semantics (same as the `*_reference` functions, the oracles; math in fp32, one rounding to the
activation dtype wherever the torch path of `worker/models/llama.py` rounds):

    add_rms_norm(x, residual, w, eps, delta=None):  # x, residual, delta: [T, hidden]
        x = x + delta                                   # if given, rounded to the dtype
        residual[:] = residual + x                      # in place, rounded to the dtype
        return rms_norm(residual, w, eps)
    rms_norm(x, w, eps):                            # HF's LlamaRMSNorm order
        return w * (x / sqrt(mean(x², -1) + eps)).to(dtype)
    rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, delta=None):
        qkv' = qkv + delta                              # if given, rounded (qkv keeps its k, v)
        q, k, v = qkv.split([H·D, KVH·D, KVH·D], -1)   # heads of D; q rotated in place
        c, s = cos_sin[positions, :D/2], cos_sin[positions, D/2:]
        rot(x) = cat(x1·c - x2·s, x2·c + x1·s)          # x1, x2 = halves of each head (rotate-half)
        q[:] = rot(q); cache_k[slot_mapping] = rot(k); cache_v[slot_mapping] = v
        return q.view(T, H, D)
    silu_mul(gate_up, delta=None):                  # [T, 2I] -> [T, I]
        gate, up = (gate_up + delta).chunk(2, -1)       # delta if given, the sum rounded
        return silu(gate).to(dtype) * up

`delta` is the LoRA side path's output when it ran beside the base GEMM on another stream
(`lora_ops.linear_lora_deferred`): adding it here, where the row is read anyway, saves the
LoRA expand's read-modify-write of the projection's output on the main stream. `delta_rows`
(`[T]` int, optional; `LoraMeta.has_lora`) names the rows whose delta is defined: elsewhere it
counts as 0 whatever it holds (a storing expand leaves those rows unwritten, nothing zeroes them).

Every launch's grid and arguments follow from tensor shapes only and nothing syncs with the host
(positions and slots are read on the device), so all of them can be captured in a CUDA graph.
Padding rows of a graph's batch bucket carry the *sink* slot (a KV block never handed out) and are
written there like any other row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels import pdl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _num_warps(block: int) -> int:
    """About 16 elements per thread, 4 to 16 warps."""
    return min(16, max(4, block // 512))


# -- RMSNorm (with the residual add) ---------------------------------------------------------------


@triton.jit
def _use_delta(rows_ptr, row, HAS_ROWS: tl.constexpr):
    """Whether this row's delta is defined: rows[row] != 0 with HAS_ROWS, else always."""
    if HAS_ROWS:
        return tl.load(rows_ptr + row) != 0
    return row >= 0


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    delta_ptr,
    rows_ptr,
    # sizes
    hidden,
    eps,
    # strides
    stride_x,
    stride_r,
    stride_o,
    stride_d,
    # meta-parameters
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. x, residual, out, delta `[T, hidden]` (unit stride in hidden); weight
    `[hidden]`; rows `[T]`: with HAS_ROWS, delta counts only where rows is not 0."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        d = tl.where(_use_delta(rows_ptr, row, HAS_ROWS), d.to(tl.float32), 0.0)  # undefined rows count as 0
        x = (x.to(tl.float32) + d).to(x.dtype)
    if ADD_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        # Rounded before it is stored and normalised, as torch's `h = h + x` then rms_norm(h).
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)  # padding lanes are 0: they add nothing
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)  # HF: cast, then scale
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, hidden] and weight [hidden]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a float16/bfloat16/float32 dtype")
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight need unit stride in hidden")


def _check_delta(
    delta: torch.Tensor | None, like: torch.Tensor, name: str, rows: torch.Tensor | None = None
) -> torch.Tensor | None:
    """-> the rows the kernel masks the delta with: None without a delta or without rows."""
    if delta is not None and (delta.shape != like.shape or delta.dtype != like.dtype or delta.stride(-1) != 1
                              or delta.device != like.device):
        raise ValueError(f"delta must be {tuple(like.shape)} {like.dtype} like {name}, with unit stride in "
                         f"features; got {tuple(delta.shape)} {delta.dtype}")
    if rows is None or delta is None:
        return None
    if rows.shape != (like.shape[0],) or rows.is_floating_point() or rows.stride(0) != 1 or rows.device != like.device:
        raise ValueError(f"delta_rows must be a contiguous [{like.shape[0]}] integer tensor on {like.device}, got "
                         f"{tuple(rows.shape)} {rows.dtype} on {rows.device}")
    return rows


def _masked_delta(delta: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The references' delta: 0 on rows that `rows` leaves out (whatever they hold, NaN included)."""
    if delta is None or rows is None:
        return delta
    return torch.where(rows.to(delta.device).unsqueeze(1) != 0, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, hidden]
    tokens, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    res = x if residual is None else residual  # not read without ADD_RESIDUAL
    dlt = x if delta is None else delta  # not read without HAS_DELTA
    _rms_norm_kernel[(tokens,)](
        x,
        res,
        weight,
        out,
        dlt,
        x if rows is None else rows,
        hidden,
        eps,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        dlt.stride(0),
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        HAS_DELTA=delta is not None,
        HAS_ROWS=rows is not None,
        num_warps=_num_warps(block),
        **pdl.launch_kwargs(pdl.row_kernel_pdl("rms_norm", x, delta is not None)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x `[T, hidden]` -> a new `[T, hidden]` tensor in x's dtype."""
    _check_norm_inputs(x, weight)
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`residual += x (+ delta)` in place, then RMSNorm of the new residual -> a new `[T, hidden]` tensor.

    x, residual, delta: `[T, hidden]` in one dtype; weight `[hidden]` in that dtype too;
    delta_rows: `[T]` int, the rows whose delta is defined (None: all).
    """
    _check_norm_inputs(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with unit stride in hidden, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    rows = _check_delta(delta, x, "x", delta_rows)
    return _launch_rms_norm(x, residual, weight, eps, delta, rows)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    delta = _masked_delta(delta, delta_rows)
    if delta is not None:
        x = x + delta
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps)


# -- RoPE + KV-cache write -----------------------------------------------------------------------


@triton.jit
def _load_plus(src, delta, mask, use_delta, HAS_DELTA: tl.constexpr):
    """src (+ delta if use_delta, the sum rounded to src's dtype) as fp32. The delta is loaded
    either way (under the same mask as src, so the loads stay vectors) and dropped where unused:
    it may hold anything there, NaN included."""
    x = tl.load(src, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.where(use_delta, tl.load(delta, mask=mask, other=0.0).to(tl.float32), 0.0)
        x = (x.to(tl.float32) + d).to(x.dtype)
    return x.to(tl.float32)


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
    x1 = _load_plus(src + offs, delta + offs, mask, use_delta, HAS_DELTA)
    x2 = _load_plus(src + offs + HALF, delta + offs + HALF, mask, use_delta, HAS_DELTA)
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
    use = _use_delta(rows_ptr, t, HAS_ROWS)
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
        x = _load_plus(k + v_offs + half * HALF, dk + v_offs + half * HALF, mask, use, HAS_DELTA)
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
    rows = _check_delta(delta, qkv, "qkv", delta_rows)
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
        num_warps=_num_warps(triton.next_power_of_2(heads) * triton.next_power_of_2(half)),
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
    delta = _masked_delta(delta, delta_rows)
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


# -- SiLU and multiply ---------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(
    # pointers
    gate_up_ptr,
    out_ptr,
    delta_ptr,
    rows_ptr,
    # sizes
    inter,
    # strides
    stride_in,
    stride_out,
    stride_d,
    # meta-parameters
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)). gate_up, delta `[T, 2I]`, out `[T, I]` (unit stride in features);
    rows `[T]`: with HAS_ROWS, delta counts only where rows is not 0."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = gate_up_ptr + t * stride_in
    drow = delta_ptr + t * stride_d
    use = _use_delta(rows_ptr, t, HAS_ROWS)
    gate = _load_plus(row + offs, drow + offs, mask, use, HAS_DELTA)
    up = _load_plus(row + inter + offs, drow + inter + offs, mask, use, HAS_DELTA)
    act = (gate * tl.sigmoid(gate)).to(gate_up_ptr.dtype.element_ty)  # torch rounds silu(gate) first
    out = act.to(tl.float32) * up
    tl.store(out_ptr + t * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(
    gate_up: torch.Tensor, delta: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) · up of gate_up `[T, 2I]` (gate columns first; plus delta, laid out alike, if
    given, on the rows delta_rows `[T]` names, or all) -> a new `[T, I]` tensor."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2·I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in FLOAT_DTYPES or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be float16, bfloat16 or float32 with unit stride in features, got {gate_up.dtype}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    rows = _check_delta(delta, gate_up, "gate_up", delta_rows)
    block = min(1024, triton.next_power_of_2(inter))
    dlt = gate_up if delta is None else delta  # not read without HAS_DELTA
    _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        dlt,
        gate_up if rows is None else rows,  # not read without HAS_ROWS
        inter,
        gate_up.stride(0),
        out.stride(0),
        dlt.stride(0),
        BLOCK=block,
        HAS_DELTA=delta is not None,
        HAS_ROWS=rows is not None,
        num_warps=4,
        **pdl.launch_kwargs(pdl.row_kernel_pdl("silu_mul", gate_up, delta is not None)),
    )
    return out


def silu_mul_reference(
    gate_up: torch.Tensor, delta: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None
) -> torch.Tensor:
    delta = _masked_delta(delta, delta_rows)
    gate, up = (gate_up if delta is None else gate_up + delta).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

"""Fused RMSNorm of the decoder layer in Triton, alone or after the residual add: one launch each.

The torch path launches 8 ops for each RMSNorm (float, pow, mean, add, rsqrt, mul, cast, mul) and
one for each residual add, two of each per layer; here each residual add is fused into the norm
after it: two `add_rms_norm` per layer, plus one plain `rms_norm` per step. Why fuse, the LoRA
`delta` and CUDA graphs: `kernels/layers/fused_delta.py`.

Two flags make the same kernel Gemma's (`worker/models/gemma2.py`): `offset` takes the weights as
Gemma stores them, offsets from 1, multiplied in fp32 before the one rounding (HF's GemmaRMSNorm
order); `x_weight` norms x before the residual add (Gemma 2's post-attention and post-feedforward
norms on a sublayer's output), so Gemma 2's four norms and two residual adds a layer are two
launches, as Llama's two norms and two adds are.

Semantics (same as the `*_reference` functions, the oracles; math in fp32, one rounding to the
activation dtype wherever the torch paths of `worker/models/llama.py` and `gemma2.py` round):

    add_rms_norm(x, residual, w, eps, delta=None, x_weight=None, offset=False):  # [T, hidden]
        x = x + delta                                   # if given, rounded to the dtype
        x = rms_norm(x, x_weight, eps, offset)          # if x_weight is given
        residual[:] = residual + x                      # in place, rounded to the dtype
        return rms_norm(residual, w, eps, offset)
    rms_norm(x, w, eps, offset=False):
        return w * (x / sqrt(mean(x², -1) + eps)).to(dtype)         # HF's LlamaRMSNorm order
        return ((x / sqrt(mean(x², -1) + eps)) * (1 + w)).to(dtype)  # offset: HF's GemmaRMSNorm
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
    masked_delta,
    row_warps,
)


@triton.jit
def _normed(xf, weight_ptr, offs, mask, hidden, eps, like_ptr, OFFSET: tl.constexpr):
    """RMSNorm of one fp32 row -> fp32 values rounded to like_ptr's dtype (the activations').
    Padding lanes of xf are 0: they add nothing to the sum."""
    dtype = like_ptr.dtype.element_ty
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        y = xf * rstd * (1.0 + w)  # HF Gemma: scale in fp32, then cast
    else:
        y = (xf * rstd).to(dtype).to(tl.float32) * w  # HF Llama: cast, then scale
    return y.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    x_weight_ptr,
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
    NORM_X: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. x, residual, out, delta `[T, hidden]` (unit stride in hidden); weight,
    x_weight `[hidden]`; rows `[T]`: with HAS_ROWS, delta counts only where rows is not 0. NORM_X
    (with ADD_RESIDUAL): x is normed with x_weight before the add."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        d = tl.where(delta_defined(rows_ptr, row, HAS_ROWS), d.to(tl.float32), 0.0)  # undefined rows count as 0
        x = (x.to(tl.float32) + d).to(x.dtype)
    xf = x.to(tl.float32)
    if ADD_RESIDUAL:
        if NORM_X:
            xf = _normed(xf, x_weight_ptr, offs, mask, hidden, eps, x_ptr, OFFSET)
        r_ptrs = residual_ptr + row * stride_r + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        # Rounded before it is stored and normalised, as torch's `h = h + x` then rms_norm(h).
        x = (r.to(tl.float32) + xf).to(r.dtype)
        tl.store(r_ptrs, x, mask=mask)
        xf = x.to(tl.float32)
    y = _normed(xf, weight_ptr, offs, mask, hidden, eps, x_ptr, OFFSET)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, hidden] and weight [hidden]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a float16/bfloat16/float32 dtype")
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight need unit stride in hidden")



def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    rows: torch.Tensor | None = None, x_weight: torch.Tensor | None = None, offset: bool = False,
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
        weight if x_weight is None else x_weight,  # not read without NORM_X
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
        NORM_X=x_weight is not None,
        OFFSET=offset,
        HAS_DELTA=delta is not None,
        HAS_ROWS=rows is not None,
        num_warps=row_warps(block),
        **pdl.launch_kwargs(pdl.row_kernel_pdl("rms_norm", x, delta is not None)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm of each row of x `[T, hidden]` -> a new `[T, hidden]` tensor in x's dtype; offset:
    the weight is Gemma's, `1 + weight` in fp32."""
    _check_norm_inputs(x, weight)
    return _launch_rms_norm(x, None, weight, eps, offset=offset)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None, x_weight: torch.Tensor | None = None, offset: bool = False,
) -> torch.Tensor:
    """`residual += x (+ delta)` in place, then RMSNorm of the new residual -> a new `[T, hidden]` tensor.

    x, residual, delta: `[T, hidden]` in one dtype; weight `[hidden]` in that dtype too;
    delta_rows: `[T]` int, the rows whose delta is defined (None: all); x_weight `[hidden]`: x (+
    delta) is RMS-normed with it before the add; offset: both weights are Gemma's (`1 + w`).
    """
    _check_norm_inputs(x, weight)
    if x_weight is not None:
        _check_norm_inputs(x, x_weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with unit stride in hidden, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    rows = check_delta(delta, x, "x", delta_rows)
    return _launch_rms_norm(x, residual, weight, eps, delta, rows, x_weight, offset)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None, x_weight: torch.Tensor | None = None, offset: bool = False,
) -> torch.Tensor:
    delta = masked_delta(delta, delta_rows)
    if delta is not None:
        x = x + delta
    if x_weight is not None:
        x = rms_norm_reference(x, x_weight, eps, offset)
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps, offset)

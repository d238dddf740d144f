"""Fused RMSNorm of the decoder layer in Triton, alone or after the residual add: one launch each.

The torch path launches 8 ops for each RMSNorm (float, pow, mean, add, rsqrt, mul, cast, mul) and
one for each residual add, two of each per layer; here each residual add is fused into the norm
after it: two `add_rms_norm` per layer, plus one plain `rms_norm` per step. Why fuse, the LoRA
`delta` and CUDA graphs: `kernels/layers/fused_delta.py`.

Semantics (same as the `*_reference` functions, the oracles; math in fp32, one rounding to the
activation dtype wherever the torch path of `worker/models/llama.py` rounds):

    add_rms_norm(x, residual, w, eps, delta=None):  # x, residual, delta: [T, hidden]
        x = x + delta                                   # if given, rounded to the dtype
        residual[:] = residual + x                      # in place, rounded to the dtype
        return rms_norm(residual, w, eps)
    rms_norm(x, w, eps):                            # HF's LlamaRMSNorm order
        return w * (x / sqrt(mean(x², -1) + eps)).to(dtype)
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
        d = tl.where(delta_defined(rows_ptr, row, HAS_ROWS), d.to(tl.float32), 0.0)  # undefined rows count as 0
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
        num_warps=row_warps(block),
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
    rows = check_delta(delta, x, "x", delta_rows)
    return _launch_rms_norm(x, residual, weight, eps, delta, rows)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    delta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    delta = masked_delta(delta, delta_rows)
    if delta is not None:
        x = x + delta
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps)

"""Final logit soft-capping (Gemma 2's `final_logit_softcapping`) in Triton: one launch where torch takes three.

transformers caps the lm_head's logits as `tanh(logits / cap) * cap` in the logits' dtype: three
elementwise passes over `[N, vocab]` (at Gemma 2's vocab of 256,000 and batch 64, ~33 MB each way
a pass in bf16). `soft_cap_` reads each logit once and writes it capped, in place. Every launch's
grid follows from the shape alone: it can be captured in a CUDA graph.

Semantics (same as `soft_cap_reference`, the oracle; math in fp32, rounded to the logits' dtype
after each of torch's three ops):

    soft_cap_(logits, cap):                          # [N, V], rows may be strided
        logits[:] = tanh(logits / cap) * cap
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels.layers.fused_delta import FLOAT_DTYPES

BLOCK = 2048


@triton.jit
def _tanh(t):
    """tanh in fp32 to a few ulps: 1 - 2 / (e^2t + 1) (saturates without overflow), and near 0, where
    that cancels, its Taylor series to t⁹ (the next term is under 1e-8 of t for |t| < 1/4)."""
    t2 = t * t
    series = t * (1.0 + t2 * (-1.0 / 3.0 + t2 * (2.0 / 15.0 + t2 * (-17.0 / 315.0 + t2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(t) < 0.25, series, 1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0))


@triton.jit
def _soft_cap_kernel(x_ptr, n_cols, stride, cap, BLOCK: tl.constexpr):
    """Grid (N, cdiv(V, BLOCK)): one block of one row, in place."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    ptrs = x_ptr + row * stride + offs
    x = tl.load(ptrs, mask=mask, other=0.0)
    dtype = x.dtype
    t = tl.math.div_rn(x.to(tl.float32), cap).to(dtype).to(tl.float32)  # IEEE division, as torch's
    t = _tanh(t).to(dtype).to(tl.float32)
    tl.store(ptrs, (t * cap).to(dtype), mask=mask)


def soft_cap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Cap logits `[N, V]` (unit stride in V) in place at `cap` > 0 -> logits."""
    if logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] float16/bfloat16/float32 with unit stride in V, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    rows, cols = logits.shape
    if rows and cols:
        _soft_cap_kernel[(rows, triton.cdiv(cols, BLOCK))](logits, cols, logits.stride(0), float(cap), BLOCK=BLOCK,
                                                           num_warps=8)
    return logits


def soft_cap_reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap

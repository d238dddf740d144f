"""DoRA's per-token epilogue: rescale the output rows of tokens whose adapter is a DoRA one.

Semantics (one fused projection, N output features; `g` per slot per feature, worker/lora/dora.py):

    for t in tokens:
        slot = token_slots[t, 0]
        if slot < 0 or not is_dora[slot]: continue        # base and plain-LoRA tokens: untouched
        v = y[t] + (delta[t] if delta is given else 0)     # base GEMM (with bias) + the LoRA delta
        y[t] = bias + g[slot] ⊙ (v - bias)                 # PEFT: g ⊙ (W x + s·B A x) + b
        if delta is given: delta[t] = 0                    # its reader adds it: already in y

A DoRA adapter is always a request's only adapter (the engine refuses it beside others), so entry
0 names it. The arithmetic is float32 whatever y's dtype. `delta` is the side path's deferred delta
(`linear.linear_lora_deferred`): its rows of tokens without an adapter may be undefined, and they
are never read here. `dora_epilogue_reference` is the CPU path and the oracle of the Triton kernel;
the kernel's programs for other tokens do two loads and nothing else, so a graph can launch it every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(y: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor, is_dora: torch.Tensor,
           token_slots: torch.Tensor, bias: torch.Tensor | None) -> None:
    t, n = y.shape
    if g.dim() != 2 or g.shape[1] != n or is_dora.shape != (g.shape[0],):
        raise ValueError(f"g {tuple(g.shape)} / is_dora {tuple(is_dora.shape)} do not fit y {tuple(y.shape)}")
    if token_slots.dim() != 2 or token_slots.shape[0] != t:
        raise ValueError(f"token_slots {tuple(token_slots.shape)} does not fit y {tuple(y.shape)}")
    if delta is not None and delta.shape != y.shape:
        raise ValueError(f"delta {tuple(delta.shape)} differs from y {tuple(y.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit y {tuple(y.shape)}")


def dora_epilogue_reference(
    y: torch.Tensor,  # [T, N], updated in place
    delta: torch.Tensor | None,  # [T, N] or None; DoRA rows zeroed
    g: torch.Tensor,  # [S, N] float32
    is_dora: torch.Tensor,  # [S] int32 (nonzero: the slot holds a DoRA adapter)
    token_slots: torch.Tensor,  # [T, k] int32, -1 = no adapter
    bias: torch.Tensor | None = None,  # [N] the base layer's bias
) -> None:
    _check(y, delta, g, is_dora, token_slots, bias)
    slots = token_slots[:, 0].long()
    dora = (slots >= 0) & (is_dora.to(slots.device)[slots.clamp(min=0)] != 0)
    rows = dora.nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    v = y.index_select(0, rows).float()
    if delta is not None:
        v = v + delta.index_select(0, rows).float()
        delta.index_fill_(0, rows, 0)
    scale = g.index_select(0, slots.index_select(0, rows)).float()
    if bias is None:
        out = scale * v
    else:
        b = bias.float()
        out = b + scale * (v - b)
    y.index_copy_(0, rows, out.to(y.dtype))


@triton.jit
def _dora_epilogue_kernel(
    y_ptr, delta_ptr, g_ptr, is_dora_ptr, slots_ptr, bias_ptr,  # pointers
    N,  # sizes
    stride_y, stride_d, stride_g, stride_slots,  # strides (rows; columns are contiguous)
    HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,  # meta-parameters
):
    """Grid (T, cdiv(N, BLOCK_N)): one token's BLOCK_N output features per program."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t * stride_slots)
    # Other tokens' programs touch nothing else: their loads and stores are masked off.
    on = (slot >= 0) & (tl.load(is_dora_ptr + tl.maximum(slot, 0)) != 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < tl.where(on, N, 0)
    v = tl.load(y_ptr + t * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        v += tl.load(delta_ptr + t * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(delta_ptr + t * stride_d + cols, tl.zeros([BLOCK_N], dtype=tl.float32).to(
            delta_ptr.dtype.element_ty), mask=mask)
    scale = tl.load(g_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_g + cols, mask=mask, other=1.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = b + scale * (v - b)
    else:
        out = scale * v
    tl.store(y_ptr + t * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=mask)


BLOCK_N = 1024


def dora_epilogue_triton(
    y: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor, is_dora: torch.Tensor, token_slots: torch.Tensor,
    bias: torch.Tensor | None = None, block_n: int = BLOCK_N,
) -> None:
    """`dora_epilogue_reference` as one launch (no host sync: a CUDA graph can capture it)."""
    _check(y, delta, g, is_dora, token_slots, bias)
    t, n = y.shape
    if t == 0 or n == 0:
        return
    for name, x in (("y", y), ("delta", delta), ("g", g), ("bias", bias)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name}'s features must be contiguous")
    if g.dtype != torch.float32 or is_dora.dtype != torch.int32 or token_slots.dtype != torch.int32:
        raise ValueError("g must be float32, is_dora and token_slots int32")
    block = min(block_n, triton.next_power_of_2(n))
    grid = (t, triton.cdiv(n, block))
    _dora_epilogue_kernel[grid](
        y, delta if delta is not None else y, g, is_dora, token_slots, bias if bias is not None else y,
        n, y.stride(0), delta.stride(0) if delta is not None else 0, g.stride(0), token_slots.stride(0),
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, BLOCK_N=block,
    )


def dora_epilogue(
    y: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor, is_dora: torch.Tensor, token_slots: torch.Tensor,
    bias: torch.Tensor | None = None, backend: str = "torch",
) -> None:
    """Dispatch to the torch reference or the Triton kernel (same semantics)."""
    if backend == "torch":
        dora_epilogue_reference(y, delta, g, is_dora, token_slots, bias)
    elif backend == "triton":
        dora_epilogue_triton(y, delta, g, is_dora, token_slots, bias)
    else:
        raise ValueError(f"unknown LoRA backend {backend!r} (torch | triton)")

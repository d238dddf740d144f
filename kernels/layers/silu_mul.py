"""Fused gated activation of the decoder's MLP in Triton: one launch where torch takes two.

`silu_mul` reads the gate_up projection's output once and writes act(gate) · up, act being the
config's `hidden_act`: SiLU (Llama, Qwen, Mistral, Phi-3) or GELU with the tanh approximation
(`gelu_pytorch_tanh`: Gemma 2 and 3), a flag of the same kernel. Why fuse, the LoRA `delta` and
CUDA graphs: `kernels/layers/fused_delta.py`.

Semantics (same as `silu_mul_reference`, the oracle; math in fp32, one rounding to the activation
dtype wherever the torch paths of `worker/models/llama.py` and `gemma2.py` round):

    silu_mul(gate_up, delta=None, activation="silu"):  # [T, 2I] -> [T, I]
        gate, up = (gate_up + delta).chunk(2, -1)       # delta if given, the sum rounded
        return act(gate).to(dtype) * up
    act: silu(g) = g · sigmoid(g);
         gelu_pytorch_tanh(g) = g/2 · (1 + tanh(u)) = g · sigmoid(2u), u = sqrt(2/π) · (g + 0.044715 g³)
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
)

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # config.json's hidden_act values the kernel computes


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
    GELU_TANH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)). gate_up, delta `[T, 2I]`, out `[T, I]` (unit stride in features);
    rows `[T]`: with HAS_ROWS, delta counts only where rows is not 0. GELU_TANH: the activation is
    GELU's tanh approximation, else SiLU."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = gate_up_ptr + t * stride_in
    drow = delta_ptr + t * stride_d
    use = delta_defined(rows_ptr, t, HAS_ROWS)
    gate = load_plus(row + offs, drow + offs, mask, use, HAS_DELTA)
    up = load_plus(row + inter + offs, drow + inter + offs, mask, use, HAS_DELTA)
    if GELU_TANH:
        # g/2 · (1 + tanh(u)) = g · sigmoid(2u): no cancellation where tanh(u) nears -1 (torch's form
        # loses there up to an fp32 ulp of 1 times |g|/2); 2 sqrt(2/π) = 1.59577...
        s = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        s = gate * tl.sigmoid(gate)
    act = s.to(gate_up_ptr.dtype.element_ty)  # torch rounds act(gate) first
    out = act.to(tl.float32) * up
    tl.store(out_ptr + t * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(
    gate_up: torch.Tensor, delta: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """act(gate) · up of gate_up `[T, 2I]` (gate columns first; plus delta, laid out alike, if
    given, on the rows delta_rows `[T]` names, or all) -> a new `[T, I]` tensor; act is one of
    ACTIVATIONS."""
    _check_activation(activation)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2·I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in FLOAT_DTYPES or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be float16, bfloat16 or float32 with unit stride in features, got {gate_up.dtype}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    rows = check_delta(delta, gate_up, "gate_up", delta_rows)
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
        GELU_TANH=activation == "gelu_pytorch_tanh",
        num_warps=4,
        **pdl.launch_kwargs(pdl.row_kernel_pdl("silu_mul", gate_up, delta is not None)),
    )
    return out


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def silu_mul_reference(
    gate_up: torch.Tensor, delta: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    _check_activation(activation)
    delta = masked_delta(delta, delta_rows)
    gate, up = (gate_up if delta is None else gate_up + delta).chunk(2, dim=-1)
    if activation == "gelu_pytorch_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up

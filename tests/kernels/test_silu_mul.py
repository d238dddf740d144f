"""Fused SiLU and multiply (`kernels/layers/silu_mul.py`): `silu_mul` against its torch reference, and the
reference against the model's torch path (`F.silu(gate) * up`).

Without CUDA the kernel runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on
small odd shapes in fp32 / fp16; with CUDA the same cases run compiled, plus bf16 at the seed shape
(`@pytest.mark.gpu`). Tolerances: `fused_cases.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorafleet.kernels.layers.silu_mul import silu_mul, silu_mul_reference
from tests.kernels.fused_cases import DEVICE, DTYPES, SEED, TOLERANCE, gpu
from tests.kernels.hopper_compile import run_hopper_compile


@DTYPES
@pytest.mark.parametrize("tokens, inter", [(1, 1), (3, 45), (2, 1500)])
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_silu_mul_matches_reference(dtype, tokens: int, inter: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 6.0).to(DEVICE, dtype)  # sigmoid's tails too
    delta = (torch.randn(tokens, 2 * inter, generator=g) * 2.0).to(DEVICE, dtype) if with_delta else None
    out = silu_mul(gate_up, delta)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_mul_reference(gate_up, delta), **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("tokens, inter", [(1, 1), (3, 45), (2, 1500)])
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_gelu_tanh_mul_matches_reference(dtype, tokens: int, inter: int, with_delta: bool) -> None:
    """activation="gelu_pytorch_tanh" (Gemma): GELU's tanh approximation of the gate, both tails."""
    g = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 6.0).to(DEVICE, dtype)
    delta = (torch.randn(tokens, 2 * inter, generator=g) * 2.0).to(DEVICE, dtype) if with_delta else None
    out = silu_mul(gate_up, delta, activation="gelu_pytorch_tanh")
    ref = silu_mul_reference(gate_up, delta, activation="gelu_pytorch_tanh")
    # fp32: torch's 1 + tanh(u) cancels in the far negative tail (up to an ulp of 1, times |g · up| / 2,
    # both here up to ~20), where the kernel's g · sigmoid(2u) does not: an absolute slack of that size.
    tol = dict(TOLERANCE[dtype], atol=6e-8 * 200) if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, **tol)
    assert not torch.allclose(ref, silu_mul_reference(gate_up, delta), **TOLERANCE[dtype])  # the flag changes it


def test_gelu_reference_is_gemmas_mlp() -> None:
    gate_up = torch.randn(3, 2 * 45, dtype=torch.float16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul_reference(gate_up, activation="gelu_pytorch_tanh"), F.gelu(gate, approximate="tanh") * up)


def test_silu_mul_refuses_an_unknown_activation() -> None:
    with pytest.raises(ValueError, match="activation"):
        silu_mul(torch.zeros(2, 4, device=DEVICE), activation="relu")


def test_silu_mul_reference_is_the_model_torch_path() -> None:
    gate_up = torch.randn(3, 2 * 45, dtype=torch.float16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul_reference(gate_up), F.silu(gate) * up)


def test_silu_mul_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="2·I"):
        silu_mul(torch.zeros(2, 5, device=DEVICE))


# Compiles the kernel for sm_90 (ptxas included) in a fresh interpreter-free process, with the
# divisibility-by-16 hints the JIT derives from real sizes, strides and pointers: what the interpreter lets
# through (dtype mixes, unsupported ops) fails here without a GPU.
HOPPER_COMPILE = r"""
from lorafleet.kernels.layers import silu_mul as ops

SIZES = ("inter",)  # 14336 at the seed shape

for dt in ("bf16", "fp16", "fp32"):
    p = "*" + dt
    silu = {"gate_up_ptr": p, "out_ptr": p, "delta_ptr": p, "rows_ptr": "*i32", "inter": "i32", "stride_in": "i32",
            "stride_out": "i32", "stride_d": "i32"}
    for gelu in (False, True):
        compile_row_variants(ops._silu_mul_kernel, silu, dict(BLOCK=1024, GELU_TANH=gelu), vectorised="silu_mul",
                             divisible=SIZES)
print("ok")
"""


def test_compiles_for_hopper() -> None:
    """The kernel compiles to sm_90 cubins (no GPU needed); skipped where this Triton lacks the API."""
    run_hopper_compile(HOPPER_COMPILE)


# -- on the GPU (run on the H200) -------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_bf16_seed_shape(tokens: int) -> None:
    """bf16 at the seed shape: within a bf16 ulp of the reference."""
    dtype = torch.bfloat16
    gate_up = torch.randn(tokens, 2 * SEED["inter"], device="cuda", dtype=dtype) * 4.0
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up))

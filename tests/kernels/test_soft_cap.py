"""Final logit soft-capping (`kernels/layers/soft_cap.py`): `soft_cap_` against its torch reference (in
place, strided rows, caps that bite), and the reference against transformers' Gemma 2 expression.

Without CUDA the kernel runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) in fp32 /
fp16 (the interpreter rounds bf16 its own way); with CUDA the same cases run compiled, plus bf16
(`@pytest.mark.gpu`). Tolerances: `fused_cases.py`.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.layers.soft_cap import soft_cap_, soft_cap_reference
from tests.kernels.fused_cases import DEVICE, DTYPES, TOLERANCE, gpu
from tests.kernels.hopper_compile import run_hopper_compile


@DTYPES
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 45), (2, 5000)])
def test_soft_cap_matches_reference_in_place(dtype, rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(rows, cols, generator=g) * 40.0).to(DEVICE, dtype)  # beyond the cap: it bites
    ref = soft_cap_reference(logits, 30.0)
    out = soft_cap_(logits, 30.0)
    assert out is logits
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    assert float(out.abs().max()) <= 30.0


def test_soft_cap_of_strided_rows_leaves_the_padding() -> None:
    """Rows of a wider buffer (the tensor-parallel gather's logits cut to the vocab): only V columns."""
    wide = torch.randn(4, 70, device=DEVICE) * 50
    before = wide.clone()
    soft_cap_(wide[:, :61], 20.0)
    torch.testing.assert_close(wide[:, :61], soft_cap_reference(before[:, :61], 20.0), **TOLERANCE[torch.float32])
    assert torch.equal(wide[:, 61:], before[:, 61:])


def test_reference_is_transformers_expression() -> None:
    logits = torch.randn(3, 45, dtype=torch.float16) * 40
    cap = 30.0
    assert torch.equal(soft_cap_reference(logits, cap), torch.tanh(logits / cap) * cap)


def test_soft_cap_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="cap"):
        soft_cap_(torch.zeros(2, 4, device=DEVICE), 0.0)
    with pytest.raises(ValueError, match="unit stride"):
        soft_cap_(torch.zeros(4, 2, device=DEVICE).T, 30.0)


HOPPER_COMPILE = r"""
from lorafleet.kernels.layers import soft_cap as ops

for dt in ("bf16", "fp16", "fp32"):
    compile_(ops._soft_cap_kernel, {"x_ptr": "*" + dt, "n_cols": "i32", "stride": "i32", "cap": "fp32"},
             dict(BLOCK=ops.BLOCK), warps=8, divisible=("n_cols",))
print("ok")
"""


def test_compiles_for_hopper() -> None:
    """The kernel compiles to sm_90 cubins (no GPU needed); skipped where this Triton lacks the API."""
    run_hopper_compile(HOPPER_COMPILE)


@pytest.mark.gpu
@gpu
def test_bf16_gemma2_vocab() -> None:
    """bf16 at Gemma 2's vocab and batch 64: within a bf16 ulp of torch's three ops."""
    logits = torch.randn(64, 256_000, device="cuda", dtype=torch.bfloat16) * 40
    ref = soft_cap_reference(logits, 30.0)
    torch.testing.assert_close(soft_cap_(logits, 30.0), ref)

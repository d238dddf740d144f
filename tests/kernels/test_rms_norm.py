"""Fused RMSNorm (`kernels/layers/rms_norm.py`): `rms_norm` and `add_rms_norm` against their torch
references, and the references against the model's torch path (`worker/models/llama.py`).

Without CUDA the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on
small odd shapes in fp32 / fp16 (hidden sizes that are not powers of two, rows of a wider buffer);
with CUDA the same cases run compiled, plus bf16 at the seed shape (`@pytest.mark.gpu`).
Tolerances: `fused_cases.py`.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.layers.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from lorafleet.worker.models import llama
from tests.kernels.fused_cases import DEVICE, DTYPES, SEED, TOLERANCE, gpu, norm_case
from tests.kernels.hopper_compile import run_hopper_compile

NORM_SHAPES = [(1, 8), (5, 37), (3, 300), (2, 1500)]


@DTYPES
@pytest.mark.parametrize("tokens, hidden", NORM_SHAPES)
def test_rms_norm_matches_reference(dtype, tokens: int, hidden: int) -> None:
    x, _, weight = norm_case(0, tokens, hidden, dtype)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("tokens, hidden", NORM_SHAPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_add_rms_norm_updates_the_residual_in_place(dtype, tokens: int, hidden: int, with_delta: bool) -> None:
    """With a delta (the LoRA side path's output), x + delta is rounded before the residual add."""
    x, residual, weight = norm_case(1, tokens, hidden, dtype)
    delta = torch.randn_like(x) if with_delta else None
    ref_residual = residual.clone()
    ref = add_rms_norm_reference(x, ref_residual, weight, 1e-6, delta)
    out = add_rms_norm(x, residual, weight, 1e-6, delta)
    assert torch.equal(residual, ref_residual)  # the same rounded adds, element by element
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_norms_read_strided_rows() -> None:
    """Rows of a wider buffer (a row stride past hidden): only `hidden` columns are read or written."""
    wide = torch.randn(4, 50, device=DEVICE)
    residual = torch.randn(4, 60, device=DEVICE)
    weight = torch.rand(37, device=DEVICE)
    x, r = wide[:, :37], residual[:, :37]
    before = residual.clone()
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), **TOLERANCE[torch.float32])
    out = add_rms_norm(x, r, weight, 1e-5)
    assert torch.equal(residual[:, 37:], before[:, 37:])
    torch.testing.assert_close(out, add_rms_norm_reference(x, before[:, :37], weight, 1e-5), **TOLERANCE[torch.float32])


@DTYPES
@pytest.mark.parametrize("tokens, hidden", NORM_SHAPES)
def test_gemma_offset_weights(dtype, tokens: int, hidden: int) -> None:
    """offset: Gemma's `1 + w` weights (offsets near 0), scaled in fp32 before the one rounding."""
    x, _, weight = norm_case(2, tokens, hidden, dtype)
    offsets = weight - 1.0
    out = rms_norm(x, offsets, 1e-6, offset=True)
    torch.testing.assert_close(out, rms_norm_reference(x, offsets, 1e-6, offset=True), **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("tokens, hidden", NORM_SHAPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma"])
def test_add_rms_norm_norms_x_before_the_add(dtype, tokens: int, hidden: int, with_delta: bool, offset: bool) -> None:
    """x_weight: x (+ delta, only on the rows delta_rows names) is normed before the residual add (Gemma 2's
    post-sublayer norms): the residual gets the normed x, rounded, and the output is the residual's norm."""
    x, residual, weight = norm_case(3, tokens, hidden, dtype)
    x_weight = torch.randn(hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype) * 0.2
    if not offset:
        x_weight = x_weight + 1.0
    delta = torch.randn_like(x) if with_delta else None
    rows = (torch.arange(tokens, device=DEVICE) % 2).int() if with_delta else None  # odd rows have a delta
    if delta is not None:
        delta[rows == 0] = float("nan")  # undefined there: must not be read as a number
    ref_residual = residual.clone()
    ref = add_rms_norm_reference(x, ref_residual, weight, 1e-6, delta, rows, x_weight=x_weight, offset=offset)
    out = add_rms_norm(x, residual, weight, 1e-6, delta, rows, x_weight=x_weight, offset=offset)
    torch.testing.assert_close(residual, ref_residual, **TOLERANCE[dtype])
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    assert not out.isnan().any()


def test_gemma_references_are_transformers_norm() -> None:
    """The offset reference is transformers' Gemma2RMSNorm, bit for bit, in fp16 (its own rounding order)."""
    transformers = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    x, residual, weight = norm_case(6, 3, 37, torch.float16, "cpu")
    hf = transformers.Gemma2RMSNorm(37, eps=1e-6).half()
    with torch.no_grad():
        hf.weight.copy_(weight - 1.0)
        assert torch.equal(rms_norm_reference(x, hf.weight, 1e-6, offset=True), hf(x))
        h = residual.clone()
        out = add_rms_norm_reference(x, h, hf.weight, 1e-6, x_weight=hf.weight, offset=True)
        assert torch.equal(h, residual + hf(x)) and torch.equal(out, hf(residual + hf(x)))


def test_rms_norm_reference_is_the_model_torch_path() -> None:
    x, residual, weight = norm_case(5, 3, 37, torch.float16, "cpu")
    assert torch.equal(rms_norm_reference(x, weight, 1e-5), llama.rms_norm(x, weight, 1e-5))


def test_norms_reject_bad_inputs() -> None:
    x, residual, weight = norm_case(8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, weight.half(), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, residual.half(), weight, 1e-5)


# Compiles the kernel for sm_90 (ptxas included) in a fresh interpreter-free process, with the
# divisibility-by-16 hints the JIT derives from real sizes, strides and pointers: what the interpreter lets
# through (dtype mixes, unsupported ops) fails here without a GPU.
HOPPER_COMPILE = r"""
from lorafleet.kernels.layers import rms_norm as ops

SIZES = ("hidden",)  # 4096 at the seed shape

for dt in ("bf16", "fp16", "fp32"):
    p = "*" + dt
    norm = {"x_ptr": p, "residual_ptr": p, "weight_ptr": p, "x_weight_ptr": p, "out_ptr": p, "delta_ptr": p,
            "rows_ptr": "*i32", "hidden": "i32",
            "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_d": "i32"}
    # Llama's (no offset) alone and after the add; Gemma's (offset) alone and with x normed first.
    for add, norm_x, offset in ((False, False, False), (True, False, False), (False, False, True), (True, True, True)):
        compile_row_variants(ops._rms_norm_kernel, norm, dict(BLOCK=4096, ADD_RESIDUAL=add, NORM_X=norm_x, OFFSET=offset),
                             vectorised="rms_norm", divisible=SIZES)
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
    """bf16 at the seed shape: each op within a bf16 ulp of its reference, the residual add exact."""
    dtype = torch.bfloat16
    x, residual, weight = norm_case(20, tokens, SEED["hidden"], dtype, "cuda")
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    ref_residual = residual.clone()
    ref = add_rms_norm_reference(x, ref_residual, weight, 1e-5)
    torch.testing.assert_close(add_rms_norm(x, residual, weight, 1e-5), ref)
    assert torch.equal(residual, ref_residual)

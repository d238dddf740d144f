"""The W8A16 FP8 GEMM (`kernels/quant/fp8_linear.py`) against its torch reference, the reference
against a dequantized bf16 weight, the quantizer's rounding, and its launch tuning as data.

Without CUDA the kernel runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on small
shapes that are not multiples of the tiles, with and without split-K and bias; it compiles for sm_90
without a GPU (`test_compiles_for_hopper`); on a GPU (`@pytest.mark.gpu`) the seed shape's four
projections at decode sizes, the prefill paths, and a CUDA-graph replay.
Tolerance: the kernel and the reference both accumulate in fp32 and round once to the output
dtype, summing in another order: a bf16 ulp of the output (rtol 1.6e-2) plus a small absolute slack.
"""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet.kernels.quant.fp8_linear import (
    FP8,
    FP8_MAX,
    dequantize,
    fp8_linear,
    fp8_linear_dequant,
    fp8_linear_ref,
    fp8_linear_scaled_mm,
    fp8_linear_triton,
    quantize_rows,
)
from lorafleet.kernels.quant.tuning import TUNINGS_DIR, LaunchConfig, load_tuning, tuning_from_dict
from tests.kernels.fused_cases import DEVICE, gpu
from tests.kernels.hopper_compile import run_hopper_compile

BF16 = dict(atol=1e-2, rtol=1.6e-2)


def case(seed: int, m: int, n: int, k: int, device: str = DEVICE, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1  # rows of different ranges
    q, s = quantize_rows(w.to(device))
    return x, w, q, s


def test_quantize_rows_rounds_each_row_to_its_own_scale() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e-3, -4.48e-3]])
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3,)
    assert q[0].float().abs().max() == FP8_MAX and q[2].float().abs().max() == FP8_MAX  # each row's max hits 448
    assert s[1] == 1.0 and torch.equal(q[1].float(), torch.zeros(3))
    # Dequantized, each element is within half an e4m3 step of the weight: 1/16 relative for normal
    # values (3 mantissa bits), 2^-10 of the row's scale for subnormal ones (steps of 2^-9).
    err = (dequantize(q, s, torch.float32) - w).abs()
    assert torch.all(err <= w.abs() / 16 + s[:, None] * 2**-10)
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(8, 512, generator=g) * torch.logspace(-6, 0, 512)  # values far below each row's max
    q, s = quantize_rows(wide)
    assert torch.all((dequantize(q, s, torch.float32) - wide).abs() <= wide.abs() / 16 + s[:, None] * 2**-10)


def test_reference_is_the_dequantized_product() -> None:
    x, _, q, s = case(0, 7, 24, 40, "cpu", torch.float32)
    expected = x @ dequantize(q, s, torch.float32).t()
    torch.testing.assert_close(fp8_linear_ref(x, q, s), expected, rtol=1e-5, atol=1e-5)


CONFIGS = [LaunchConfig(256, 16, 16, 32), LaunchConfig(256, 32, 32, 16, split_k=3),
           LaunchConfig(256, 16, 64, 64, split_k=2, warps=2, stages=2),
           LaunchConfig(256, 16, 32, 32, swap_ab=True), LaunchConfig(256, 32, 16, 16, split_k=3, swap_ab=True)]


@pytest.mark.parametrize("m, n, k", [(1, 48, 80), (5, 33, 96), (19, 100, 64), (40, 17, 50)])
@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "split3", "split2-wide", "swap", "swap-split3"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_triton_matches_reference(m: int, n: int, k: int, config: LaunchConfig, bias: bool) -> None:
    x, _, q, s = case(m * 1000 + n, m, n, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE, x.dtype) if bias else None
    out = fp8_linear_triton(x, q, s, b, config=config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, fp8_linear_ref(x, q, s, b), **BF16)


def test_triton_reads_strided_rows_and_refuses_bad_operands() -> None:
    x, _, q, s = case(3, 6, 32, 64)
    wide = torch.zeros(6, 100, dtype=x.dtype, device=DEVICE)
    wide[:, 10:74] = x
    view = wide[:, 10:74]  # rows 100 apart
    torch.testing.assert_close(fp8_linear_triton(view, q, s, config=CONFIGS[0]), fp8_linear_ref(x, q, s), **BF16)
    with pytest.raises(ValueError, match="agree on K"):
        fp8_linear_triton(x[:, :32], q, s)
    with pytest.raises(ValueError, match="fp32 scale"):
        fp8_linear_triton(x, q.float(), s)
    assert fp8_linear_triton(x[:0], q, s, config=CONFIGS[0]).shape == (0, 32)


def test_fp8_linear_on_cpu_is_the_reference() -> None:
    """The ops switch: CPU tensors take the torch reference, leading dimensions kept."""
    x, _, q, s = case(4, 6, 24, 32, "cpu")
    out = fp8_linear(x.reshape(2, 3, 32), q, s)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out.reshape(6, 24), fp8_linear_ref(x, q, s))


def test_tuning_files_load_and_pick_by_rows_and_shape(tmp_path) -> None:
    for path in sorted(TUNINGS_DIR.glob("*.json")):
        t = tuning_from_dict(json.loads(path.read_text()))
        assert [c.max_m for c in t.decode] == sorted(c.max_m for c in t.decode)
    t = load_tuning("")
    assert t.pick(1, 4096, 4096).max_m >= 1 and t.pick(1, 4096, 4096) is t.decode[0]
    assert t.pick(100_000, 4096, 4096) == t.prefill_config
    shaped = load_tuning("", json.dumps({"shapes": {"64x32": [dict(max_m=8, block_m=16, block_n=16, block_k=32)]}}))
    assert shaped.pick(4, 64, 32).block_n == 16 and shaped.pick(4, 65, 32) == t.pick(4, 65, 32)
    assert shaped.pick(9, 64, 32) == t.pick(9, 64, 32)  # past the shape's table: the general one
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(16, 16, 24, 32)
    with pytest.raises(ValueError, match="unknown FP8 tuning fields"):
        tuning_from_dict({**json.loads((TUNINGS_DIR / "default.json").read_text()), "blocks": 1})
    with pytest.raises(ValueError, match="prefill must be"):
        load_tuning("", '{"prefill": "cublas"}')
    assert load_tuning("NVIDIA H100 80GB HBM3").prefill in ("triton", "dequant", "scaled_mm")


HOPPER_COMPILE = r"""
import re

from lorafleet.kernels.quant import fp8_linear as ops

sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
for bm, bn, bk, split, warps, stages, even, bias, swap in (
        (16, 64, 256, 1, 4, 4, True, False, False), (64, 64, 128, 1, 4, 4, True, False, False),
        (128, 128, 64, 1, 8, 3, True, False, False), (16, 32, 128, 4, 4, 4, True, False, False),
        (32, 256, 64, 2, 4, 3, False, True, False), (128, 64, 128, 1, 8, 4, False, True, False),
        (64, 128, 128, 1, 4, 4, True, False, True), (16, 64, 256, 2, 4, 4, False, True, True)):
    s = dict(sig, out_ptr="*fp32") if split > 1 else sig
    k = compile_(ops._w8a16_kernel, s, dict(HAS_BIAS=bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                 GROUP_M=8, EVEN_K=even, DOT_F32=False, SWAP_AB=swap), warps=warps, stages=stages, divisible=("K",))
    ptx = k.asm["ptx"]
    assert "cvt.rn.bf16x2.e4m3x2" in ptx or "cvt.rn.f16x2.e4m3x2" in ptx, "no hardware e4m3 conversion"
    assert bool(re.search(r"\s(red|atom)\.global", ptx)) == (split > 1), "atomics only for a split K"
print("ok")
"""


def test_compiles_for_hopper() -> None:
    """The kernel compiles to sm_90 (no GPU needed): e4m3 converted by the hardware, atomics only when split."""
    run_hopper_compile(HOPPER_COMPILE)


# -- on the GPU --------------------------------------------------------------------------------

SEED_GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 7, 64, 200, 256])
@pytest.mark.parametrize("proj", list(SEED_GEMMS))
def test_seed_shape_decode(m: int, proj: str) -> None:
    n, k = SEED_GEMMS[proj]
    x, _, q, s = case(m, m, n, k, "cuda")
    torch.testing.assert_close(fp8_linear(x, q, s), fp8_linear_ref(x, q, s), **BF16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["triton", "dequant", "scaled_mm"])
def test_seed_shape_prefill_paths(path: str) -> None:
    n, k = SEED_GEMMS["gate_up"]
    x, _, q, s = case(9, 1000, n, k, "cuda")
    ref = fp8_linear_ref(x, q, s)
    if path == "triton":
        out = fp8_linear_triton(x, q, s, config=load_tuning("").prefill_config)
    elif path == "dequant":
        out = fp8_linear_dequant(x, q, s)
    else:
        out = fp8_linear_scaled_mm(x, q, s)
    # scaled_mm rounds the activations to e4m3 too: a relative error of a few percent of the row's scale.
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (0.05 if path == "scaled_mm" else 5e-3), rel


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay_matches_eager() -> None:
    n, k = SEED_GEMMS["o"]
    x, _, q, s = case(11, 64, n, k, "cuda")
    split = LaunchConfig(256, 64, 32, 128, split_k=4)
    eager = (fp8_linear(x, q, s), fp8_linear_triton(x, q, s, config=split))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (fp8_linear(x, q, s), fp8_linear_triton(x, q, s, config=split))
    x.mul_(2.0)
    graph.replay()
    torch.testing.assert_close(outs[0], 2 * eager[0], **BF16)
    torch.testing.assert_close(outs[1], 2 * eager[1], **BF16)

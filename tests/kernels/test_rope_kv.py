"""Fused RoPE + KV write (`kernels/layers/rope_kv.py`): `rope_write_kv` against its torch reference, and
the reference against the model's torch path (`Rotary.apply` + `write_kv`).

Without CUDA the kernel runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on
small odd shapes in fp32 / fp16: GQA and MHA, a head_dim whose half is not a power of two,
positions up to 100k, padding rows that write the KV sink. With CUDA the same cases run compiled,
plus bf16 at the seed shape (`@pytest.mark.gpu`). Tolerances: `fused_cases.py`.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.layers.rope_kv import rope_write_kv, rope_write_kv_reference
from lorafleet.worker.layers.attention import write_kv
from lorafleet.worker.models.llama import Rotary
from tests.kernels.fused_cases import DTYPES, POSITIONS, SEED, SLOTS, TOLERANCE, gpu, rope_case, rotary
from tests.kernels.hopper_compile import run_hopper_compile

# (heads, kv_heads, head_dim): GQA 2:1, MHA with odd heads, half = 6 (not a power of two), 5:1.
HEAD_SHAPES = [(4, 2, 16), (3, 3, 8), (6, 2, 12), (5, 1, 64)]


@DTYPES
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_rope_write_kv_matches_reference(dtype, heads: int, kv_heads: int, head_dim: int, with_delta: bool) -> None:
    qkv, positions, k_cache, v_cache, slots = rope_case(2, heads, kv_heads, head_dim, dtype)
    delta = None
    if with_delta:  # the same on padding rows, as their qkv (see rope_case)
        delta = torch.randn_like(qkv)
        delta[-2:] = delta[-2]
    cos_sin = rotary(head_dim, 100_000).cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_q = rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots, delta)
    q = rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, delta)
    assert q.shape == (len(POSITIONS), heads, head_dim) and q.data_ptr() == qkv.data_ptr()  # a view
    torch.testing.assert_close(q, ref_q, **TOLERANCE[dtype])
    torch.testing.assert_close(qkv, ref_qkv, **TOLERANCE[dtype])  # k and v columns untouched
    # Written slots (the sink included) match; every other slot still holds its NaN.
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, **TOLERANCE[dtype])
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    written = k_cache.flatten(0, 1).isnan().flatten(1).any(1).logical_not().nonzero().flatten()
    assert written.tolist() == sorted(set(SLOTS))


def test_rope_write_kv_takes_int32_indices_and_other_cache_dtypes() -> None:
    """int32 positions and slots; an fp16 cache below fp32 activations (cast on the store, as write_kv)."""
    qkv, positions, k_cache, v_cache, slots = rope_case(3, 4, 2, 16, torch.float32)
    cos_sin = rotary(16, 100_000).cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.half(), v_cache.half()
    rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots)
    k_half, v_half = k_cache.half(), v_cache.half()
    rope_write_kv(qkv, positions.int(), cos_sin, k_half, v_half, slots.int())
    torch.testing.assert_close(qkv, ref_qkv, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k_half, ref_k, equal_nan=True)
    torch.testing.assert_close(v_half, ref_v, equal_nan=True)


def test_rope_reference_is_the_model_torch_path() -> None:
    """Rotary.apply + write_kv (in fp32) give what the reference gives; cos_sin holds Rotary's tables."""
    heads, kv_heads, head_dim = 4, 2, 16
    rot = rotary(head_dim, 100_000, "cpu")
    half = head_dim // 2
    assert torch.equal(rot.cos_sin, torch.cat([rot.cos[:, :half], rot.sin[:, :half]], dim=-1))
    qkv, positions, k_cache, v_cache, slots = rope_case(4, heads, kv_heads, head_dim, torch.float32, "cpu")
    cos, sin = rot.at(positions, torch.float32)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = Rotary.apply(q.reshape(-1, heads, head_dim), cos, sin)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, Rotary.apply(k.reshape(-1, kv_heads, head_dim), cos, sin),
             v.reshape(-1, kv_heads, head_dim), slots)
    got_q = rope_write_kv_reference(qkv, positions, rot.cos_sin, k_cache, v_cache, slots)
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k_cache, want_k, equal_nan=True, **TOLERANCE[torch.float32])
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


def test_rope_write_kv_rejects_bad_inputs() -> None:
    qkv, positions, k_cache, v_cache, slots = rope_case(6, 4, 2, 16, torch.float32)
    cos_sin = rotary(16, 100_000).cos_sin
    with pytest.raises(ValueError, match="qkv must be"):
        rope_write_kv(qkv[:, :-8], positions, cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="positions and slot_mapping"):
        rope_write_kv(qkv, positions[:-1], cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope_write_kv(qkv, positions, cos_sin.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="integer"):
        rope_write_kv(qkv, positions.float(), cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches"):
        rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache[:, :2], slots)


# Compiles the kernel for sm_90 (ptxas included) in a fresh interpreter-free process, with the
# divisibility-by-16 hints the JIT derives from real sizes, strides and pointers: what the interpreter lets
# through (dtype mixes, unsupported ops) fails here without a GPU.
HOPPER_COMPILE = r"""
from lorafleet.kernels.layers import rope_kv as ops

for dt in ("bf16", "fp16", "fp32"):
    p = "*" + dt
    rope = {"qkv_ptr": p, "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64",
            "k_cache_ptr": p, "v_cache_ptr": p, "delta_ptr": p, "rows_ptr": "*i32", "num_heads": "i32",
            "num_kv_heads": "i32",
            **{s: "i32" for s in ("stride_qkv", "stride_d", "stride_cs", "stride_kb", "stride_ks", "stride_kh",
                                  "stride_vb", "stride_vs", "stride_vh")}}
    compile_row_variants(ops._rope_write_kv_kernel, rope,
                         dict(HALF=64, HALF_PAD=64, H_PAD=32, KVH_PAD=8, BLOCK_SIZE=16))
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
    """bf16 at the seed shape: q and the K cache within a bf16 ulp of the reference, the V cache exact."""
    dtype = torch.bfloat16
    heads, kv_heads, head_dim = SEED["heads"], SEED["kv_heads"], SEED["head_dim"]
    g = torch.Generator().manual_seed(21)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to("cuda", dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g).cuda()
    num_blocks = 2 * tokens
    slots = (torch.randperm(num_blocks * 16, generator=g)[:tokens]).cuda()  # distinct slots
    k_cache = torch.zeros(num_blocks, 16, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cos_sin = rotary(head_dim, 4096, "cuda").cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots)
    rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots)
    torch.testing.assert_close(qkv, ref_qkv)
    torch.testing.assert_close(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)

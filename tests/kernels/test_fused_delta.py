"""The LoRA delta of the fused row kernels (`kernels/layers/fused_delta.py`), through each op: with
`delta_rows` the delta counts only on the rows it names, and bad deltas or rows are rejected.

Runs in the Triton interpreter without CUDA (conftest.py sets TRITON_INTERPRET=1), compiled with
it. Tolerances: `fused_cases.py`.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.layers.rms_norm import add_rms_norm, add_rms_norm_reference
from lorafleet.kernels.layers.rope_kv import rope_write_kv, rope_write_kv_reference
from lorafleet.kernels.layers.silu_mul import silu_mul, silu_mul_reference
from tests.kernels.fused_cases import DEVICE, TOLERANCE, norm_case, rope_case, rotary


def test_delta_rows_leave_the_other_rows_delta_unread() -> None:
    """A storing LoRA expand defines the delta only on rows of tokens with an adapter: with
    `delta_rows`, each op adds it there and nowhere else (the other rows hold NaN, which would show),
    against the references given the same rows, and against no delta at all on the left-out rows."""
    dtype = torch.float16
    rows = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    off = rows == 0
    tokens = rows.numel()

    def poisoned(like: torch.Tensor) -> torch.Tensor:
        d = torch.randn_like(like)
        d[off] = float("nan")
        return d

    x, residual, weight = norm_case(3, tokens, 300, dtype)
    delta = poisoned(x)
    ref_res, plain_res = residual.clone(), residual.clone()
    ref = add_rms_norm_reference(x, ref_res, weight, 1e-6, delta, rows)
    plain = add_rms_norm(x, plain_res, weight, 1e-6)  # no delta at all
    out = add_rms_norm(x, residual, weight, 1e-6, delta, rows)
    assert not out.isnan().any() and not residual.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    torch.testing.assert_close(residual, ref_res, **TOLERANCE[dtype])
    assert torch.equal(out[off], plain[off]) and not torch.equal(out[~off], plain[~off])

    g = torch.Generator().manual_seed(9)
    gate_up = torch.randn(tokens, 90, generator=g).to(DEVICE, dtype)
    delta = poisoned(gate_up)
    out = silu_mul(gate_up, delta, rows)
    torch.testing.assert_close(out, silu_mul_reference(gate_up, delta, rows), **TOLERANCE[dtype])
    assert torch.equal(out[off], silu_mul(gate_up)[off])

    qkv, positions, k_cache, v_cache, slots = rope_case(4, 4, 2, 16, dtype)
    rows[-2:] = 0  # the two padding rows alike (see rope_case)
    off = rows == 0
    delta = poisoned(qkv)
    cos_sin = rotary(16, 100_000).cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_q = rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots, delta, rows)
    q = rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, delta, rows)
    assert not q.isnan().any()
    torch.testing.assert_close(q, ref_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, **TOLERANCE[dtype])
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))


def test_ops_reject_bad_deltas() -> None:
    x, residual, weight = norm_case(8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(x, residual, weight, 1e-5, delta=x[:1])
    with pytest.raises(ValueError, match="delta must be"):
        silu_mul(torch.zeros(2, 8, device=DEVICE), delta=torch.zeros(2, 8, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="delta_rows must be"):
        add_rms_norm(x, residual, weight, 1e-5, x.clone(), torch.ones(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="delta_rows must be"):
        silu_mul(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE), torch.ones(2, device=DEVICE))

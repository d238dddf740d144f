"""bench/layer_kernels.py: the launches of a decode step per decoder layer, counted on CPU (the Triton
kernels in the interpreter). Gemma 2's layer launches as many kernels as Llama's on the Triton path
(the engine's on CUDA): its extra norms, residual adds and GELU-tanh ride in Llama's row kernels."""

from __future__ import annotations

import os

import pytest


def test_gemma2_layer_launches_as_many_kernels_as_llamas(bench_importable) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts the Triton launches on CPU in the interpreter")
    from bench.layer_kernels import layer_counts

    llama, gemma = (layer_counts(arch, "triton", batch=3) for arch in ("llama", "gemma2"))
    row_kernels = {"triton._rope_write_kv_kernel": 1, "triton._rms_norm_kernel": 2, "triton._silu_mul_kernel": 1}
    for r in (llama, gemma):
        assert r["layer_ops"] == {"aten.linear": 4, "triton._paged_decode_kernel": 1, **row_kernels}, r["arch"]
        assert r["per_layer"] == 9
    # Per step besides the layers: Gemma's embedding scale and final soft-capping (one kernel) on top of Llama's.
    assert gemma["step_ops"] == {**llama["step_ops"], "aten.mul": 1, "triton._soft_cap_kernel": 1}
    # The torch path (CPU) counts its elementwise ops one by one: many more a layer.
    assert layer_counts("llama", "torch", batch=3)["per_layer"] > 30

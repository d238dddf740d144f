"""bench/gemm_lora.py, the GEMM with its LoRA in one kernel (fused_gemm_bound's experiment): under
the interpreter its two-launch form (shrink, then GEMM + expand) and the GEMM alone match the fp32
reference, with K splits, true ranks below the tile, tokens without an adapter and several slices,
and leave the workspace reusable (a second launch gives the same result)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter")


@pytest.fixture
def gemm_lora(tmp_path, monkeypatch):
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the repo root itself would shadow the stdlib's operator
    monkeypatch.syspath_prepend(str(tmp_path))
    from bench import gemm_lora

    return gemm_lora


@pytest.mark.parametrize("split,pieces,r_chunk", [(1, 4, 8), (2, 2, 4)])
def test_split_launches_match_the_reference(gemm_lora, split, pieces, r_chunk) -> None:
    g = torch.Generator().manual_seed(0)
    t, k, slots, r = 16, 256, 5, 8
    slices = (64, 32, 32)
    n = sum(slices)
    x = torch.randn(t, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / 16).bfloat16()
    a = (torch.randn(slots, len(slices), r, k, generator=g) / 16).bfloat16()
    b = torch.randn(slots, r, n, generator=g).bfloat16()
    slot = torch.randint(-1, slots, (t,), generator=g).int()
    slot[:2] = torch.tensor([-1, 0])  # a token without an adapter, one with the full rank
    lora = gemm_lora.FusedLora(a, b, slices, slot, torch.rand(t, generator=g) + 0.5,
                               torch.tensor([8, 1, 7, 3, 0], dtype=torch.int32))
    cfg = gemm_lora.GemmConfig(block_n=32, block_k=64, split=split, pieces=pieces, block_ks=64, r_chunk=r_chunk)
    base = gemm_lora.gemm_lora_reference(x, w, None)
    ref = gemm_lora.gemm_lora_reference(x, w, lora)
    assert (ref - base).norm() > 0.5 * base.norm()  # the LoRA is a large part of the output
    for fused, want in ((None, base), (lora, ref)):
        ws = gemm_lora.new_workspace(t, n, fused, cfg, "cpu")
        for _ in range(2):
            y = torch.full((t, n), float("nan")).bfloat16()
            gemm_lora.gemm_lora(x, w, y, fused, ws, cfg, phases="split")
            assert float((y.float() - want).norm() / want.norm()) < 1e-2
            assert not ws.tile_count.any()  # the split counters are back to zero


def test_refuses_shapes_it_cannot_tile(gemm_lora) -> None:
    cfg = gemm_lora.GemmConfig(block_n=32, block_k=64)
    x, w = torch.zeros(16, 100).bfloat16(), torch.zeros(64, 100).bfloat16()
    ws = gemm_lora.new_workspace(16, 64, None, cfg, "cpu")
    with pytest.raises(ValueError, match="unsupported shape"):
        gemm_lora.gemm_lora(x, w, torch.zeros(16, 64).bfloat16(), None, ws, cfg)

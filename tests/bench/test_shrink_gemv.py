"""bench/shrink_gemv.py's experimental shrink against the production one, in the interpreter: the
same partials for one-row and many-row chunks, padding chunks, rank 0 and odd ranks, 1-3 slices,
K not a multiple of the tile, and empty K splits (so the next GPU session only has to time it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture
def gemv(tmp_path, monkeypatch):
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the repo root itself would shadow the stdlib's operator
    monkeypatch.syspath_prepend(str(tmp_path))
    from bench import shrink_gemv

    return shrink_gemv


@pytest.mark.parametrize(
    "tokens,slots,d_in,outs,ranks,split_k,block_k",
    [
        (6, 6, 72, [24], [[16, 7, 16, 1, 16, 16]], 2, 32),  # a row a chunk, odd ranks
        (40, 3, 100, [24, 8, 8], [[16, 16, 8], [4, 0, 16], [16, 1, 0]], 3, 32),  # many-row chunks, rank 0
        (9, 4, 48, [16, 16], [[32, 20, 16, 1], [32, 32, 0, 8]], 4, 64),  # two rank blocks; empty K splits
    ],
)
def test_gemv_shrink_matches_the_production_shrink(gemv, tokens, slots, d_in, outs, ranks, split_k, block_k):
    from lorafleet.kernels.lora_ops import build_lora_meta
    from lorafleet.kernels.triton_lora import LoraKernelConfig, launch_shrink, plan_lora_triton

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    g = torch.Generator().manual_seed(tokens)
    r_max = max(max(r) for r in ranks)
    lora_a = [torch.randn(slots, r_max, d_in, generator=g).to(device) for _ in outs]
    for a, slice_ranks in zip(lora_a, ranks, strict=True):
        for slot, r in enumerate(slice_ranks):
            a[slot, r:] = float("nan")  # past the true rank: must not be read
    lora_b = [torch.randn(slots, o, r_max, generator=g).to(device) for o in outs]
    token_slots = torch.randint(-1, slots, (tokens, 1), generator=g).to(torch.int32)
    meta = build_lora_meta(token_slots, torch.rand(tokens, 1, generator=g) + 0.5, slots, device=device,
                           chunk_size=16)
    x = torch.randn(tokens, d_in, generator=g).to(device)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=device)
    cfg = LoraKernelConfig(split_k=split_k, block_k=32, block_n=16, n_per_prog=32)
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_dev, meta, cfg, pdl=False)
    plan.part.fill_(float("nan"))
    launch_shrink(plan)
    ref = plan.part.clone()
    plan.part.fill_(float("nan"))
    gemv.launch_shrink_gemv(plan, block_k, 2)
    written = ~torch.isnan(ref)  # rows of tokens without an adapter, ranks past the slot's: neither writes them
    assert torch.equal(written, ~torch.isnan(plan.part))
    # The K splits may cut K differently (each kernel rounds a split to its own K tile): the expand
    # reads their sum.
    torch.testing.assert_close(plan.part.nan_to_num(0).sum(0), ref.nan_to_num(0).sum(0), rtol=1e-4, atol=1e-4)

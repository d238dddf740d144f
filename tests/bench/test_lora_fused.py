"""bench/lora_fused.py: the one-launch kernel (shrink programs, then expand programs waiting on a
flag a chunk) computes what the reference does and leaves its counters zero, under the interpreter
(which runs the programs in order, so each flag is full before its expand programs poll it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter")


@pytest.fixture
def fused(tmp_path, monkeypatch):
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the repo root itself would shadow the stdlib's operator
    monkeypatch.syspath_prepend(str(tmp_path))
    from bench import lora_fused

    return lora_fused


@pytest.mark.parametrize("tokens,slots,outs,k,store,ticket,rows,rank_major", [
    (20, 7, [40, 24, 24], 1, False, True, False, True),
    (20, 7, [40, 24, 24], 1, True, False, True, True),
    (9, 9, [72], 1, True, True, True, False),
    (33, 2, [24, 100], 2, False, True, False, True),
    (33, 5, [24, 100], 3, False, False, False, True),
])
def test_one_launch_matches_the_reference(fused, tokens, slots, outs, k, store, ticket, rows, rank_major) -> None:
    from lorafleet.kernels.lora_ops import add_lora, build_lora_meta, new_lora_b
    from lorafleet.kernels.triton_lora import LoraKernelConfig, plan_lora_triton

    g = torch.Generator().manual_seed(tokens + k)
    d_in, r_max = 80, 16
    ranks = [[16 if s % 3 else 8 for s in range(slots)] for _ in outs]
    ranks[0][0] = 0  # one slot leaves the first slice untargeted
    lora_a = [torch.randn(slots, r_max, d_in, generator=g) / 9 for _ in outs]
    lora_b = []
    for o in outs:
        b = new_lora_b(slots, o, r_max, device="cpu", dtype=torch.float32) if rank_major else torch.empty(slots, o, r_max)
        b.copy_(torch.randn(slots, o, r_max, generator=g) / 4)
        lora_b.append(b)
    token_slots = torch.randint(-1, slots, (tokens, k), generator=g, dtype=torch.int32)
    meta = build_lora_meta(token_slots, torch.rand(tokens, k, generator=g) + 0.5, slots, "cpu")
    ranks_dev = torch.tensor(ranks, dtype=torch.int32)
    x = torch.randn(tokens, d_in, generator=g)
    y = torch.randn(tokens, sum(outs), generator=g)
    ref = torch.zeros_like(y) if store else y.clone()
    add_lora(ref, x, lora_a, lora_b, ranks, ranks_dev, meta, backend="torch")
    cfg = LoraKernelConfig(split_k=2, block_k=32, block_n=16, n_per_prog=32, shrink_rows=rows)
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_dev, meta, config=cfg)
    plan.part.fill_(float("nan"))
    sync = fused.new_sync(meta.max_chunks, "cpu")
    out = torch.full_like(y, float("nan")) if store else y.clone()
    fused.launch_fused(plan, out, sync, store=store, ticket=ticket)
    if store:  # rows of tokens without an adapter are left undefined
        out = torch.where((token_slots >= 0).any(1)[:, None], out, 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert (sync == 0).all(), "every counter back to zero for the next launch"

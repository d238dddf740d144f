"""bench/lora_bytes_only.py, the bytes-only side path of overlap_sweep's bound: under the interpreter
it reads each chunk's slot's true-rank rows of A and B once (no more: padding rows past the rank and
other slots are never summed) and zeroes the delta where the real path would have written it."""

from __future__ import annotations

import os

import pytest
import torch

from lorafleet.kernels.lora.launch import plan_lora_triton
from lorafleet.kernels.lora.meta import build_lora_meta

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter")


@pytest.fixture
def bytes_only(bench_importable, monkeypatch):
    from bench import lora_bytes_only

    monkeypatch.setattr(lora_bytes_only, "BLOCK", 16)  # several blocks a program at these sizes
    return lora_bytes_only


def test_reads_each_chunks_true_rank_rows_once_and_zeroes_the_delta(bytes_only, positive_stacks) -> None:
    g = torch.Generator().manual_seed(0)
    slots, r_max, in_f, outs = 5, 8, 40, [24, 8]
    ranks = torch.tensor([[8, 3, 0, 5, 1], [2, 3, 7, 5, 0]], dtype=torch.int32)
    a, b = positive_stacks(g, slots, r_max, in_f, outs)
    # slot 3 twice as many pairs as a chunk holds: two chunks, each reads it; slot 0 unused
    token_slots = torch.tensor([[1]] * 3 + [[3]] * 20 + [[4]] + [[-1]] * 2, dtype=torch.int32)
    meta = build_lora_meta(token_slots, torch.ones(len(token_slots), 1), slots)
    x = torch.randn(len(token_slots), in_f, generator=g)
    plan = plan_lora_triton(x, a, b, ranks, meta)
    chunk_slots = [s for s in meta.chunk_slot.tolist() if s >= 0]
    assert sorted(chunk_slots) == [1, 3, 3, 4]

    probe = torch.zeros(meta.grid_chunks * 3 * bytes_only.PIECES)
    bytes_only._read(plan.lora_a, plan, 2, probe=probe)
    want_a = sum(float(a[i][slot, : int(ranks[i, slot])].sum()) for slot in chunk_slots for i in range(len(a)))
    assert probe.sum().item() == pytest.approx(want_a, rel=1e-6)
    probe.zero_()
    bytes_only._read(plan.lora_b, plan, 1, probe=probe)
    want_b = sum(float(b[i][slot, :, : int(ranks[i, slot])].sum()) for slot in chunk_slots for i in range(len(b)))
    assert probe.sum().item() == pytest.approx(want_b, rel=1e-6)

    delta = torch.full((len(token_slots), sum(outs)), 7.0)
    bytes_only.launch_expand(plan, delta, store=True)
    assert not delta.any()
    zeroed = torch.full_like(delta, 7.0)
    bytes_only.launch_shrink(plan, zero=zeroed)
    assert not zeroed.any() and plan.shrink_zeroes

"""bench/read_speed_linear.py, overlap_sweep's read-speed projections: under the interpreter one
launch (or two) reads the base weight once and each chunk's slot's true-rank rows of every slice's
A and B once (padding rows past the rank and other slots never), and returns zeros."""

from __future__ import annotations

import os

import pytest
import torch

from lorafleet.kernels.lora.meta import build_lora_meta

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter")


@pytest.fixture
def read_speed(bench_importable, monkeypatch):
    from bench import read_speed_linear

    monkeypatch.setattr(read_speed_linear, "W_BLOCK", 64)  # several programs and blocks at these sizes
    monkeypatch.setattr(read_speed_linear, "W_ITERS", 2)
    monkeypatch.setattr(read_speed_linear, "AD_BLOCK", 16)
    return read_speed_linear


@pytest.mark.parametrize("one_launch", [True, False])
def test_reads_the_weight_and_each_chunks_true_rank_rows_once(read_speed, positive_stacks, monkeypatch,
                                                              one_launch) -> None:
    monkeypatch.setattr(read_speed, "ONE_LAUNCH", one_launch)
    g = torch.Generator().manual_seed(0)
    slots, r_max, in_f, outs = 5, 8, 40, [24, 8, 16]
    ranks = torch.tensor([[8, 3, 0, 5, 1], [2, 3, 7, 5, 0], [1, 1, 1, 8, 8]], dtype=torch.int32)
    a, b = positive_stacks(g, slots, r_max, in_f, outs)
    w = torch.rand(sum(outs), in_f, generator=g) + 1
    token_slots = torch.tensor([[1]] * 3 + [[3]] * 20 + [[4]] + [[-1]] * 2, dtype=torch.int32)
    meta = build_lora_meta(token_slots, torch.ones(len(token_slots), 1), slots)
    chunk_slots = [s for s in meta.chunk_slot.tolist() if s >= 0]
    assert sorted(chunk_slots) == [1, 3, 3, 4]  # slot 3 in two chunks: read twice, as the real kernels do
    x = torch.randn(len(token_slots), in_f, generator=g)

    w_programs = -(-w.numel() // (64 * 2))
    probe = torch.zeros(w_programs + meta.grid_chunks * 6 * read_speed.AD_PIECES)
    y = read_speed.read_linear(x, w, a, b, ranks, meta, probe=probe)
    want_ad = sum(float(a[i][s, : int(ranks[i, s])].sum()) + float(b[i][s, :, : int(ranks[i, s])].sum())
                  for s in chunk_slots for i in range(len(outs)))
    assert probe[:w_programs].sum().item() == pytest.approx(float(w.sum()), rel=1e-6)
    assert probe[w_programs:].sum().item() == pytest.approx(want_ad, rel=1e-6)
    assert y.shape == (len(token_slots), sum(outs)) and not y.any()

    probe.zero_()
    y = read_speed.read_linear(x, w, probe=probe)  # no adapters: the weight alone
    assert probe.sum().item() == pytest.approx(float(w.sum()), rel=1e-6)
    assert not y.any()

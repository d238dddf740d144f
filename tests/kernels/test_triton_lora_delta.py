"""The side path's delta through the Triton launches against `add_lora_reference`: the shrink
zeroing it, the storing expand (one adapter per token), and what the storing expand refuses."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.kernels.lora.ops import add_lora
from tests.kernels.lora_cases import DEVICE, LAYOUTS, TOL, make_weights


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("launch_bound", [None, 8])
def test_shrink_zeroes_the_delta_it_expands_into(k: int, launch_bound: int | None, rows: bool) -> None:
    """The side path's delta is not memset: the shrink's programs (padding chunks' too) zero it,
    then the expand accumulates into it. A NaN-poisoned buffer, tokens without an adapter, a slot
    that leaves a slice untargeted (rank 0), and more elements than one block per program; with
    the shrink a row at a time too."""
    from lorafleet.kernels.lora.config import pick_config
    from lorafleet.kernels.lora.launch import launch_expand, launch_shrink, plan_lora_triton

    g = torch.Generator().manual_seed(3 + k)
    tokens, slots, d_in, outs = 40, 5, 48, [700, 300]
    ranks = [[8, 16, 0, 4, 16], [16, 1, 8, 0, 16]]
    lora_a, lora_b = make_weights(g, slots, 16, d_in, outs, ranks, torch.float32, DEVICE, "rank_major")
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    token_slots = torch.randint(-1, slots, (tokens, k), generator=g, dtype=torch.int32)
    meta = build_lora_meta(token_slots, torch.rand(tokens, k, generator=g) + 0.5, slots, DEVICE)
    if launch_bound is not None:
        meta.launch_chunks = max(launch_bound, meta.num_chunks)  # padding chunks in the grid
    x = torch.randn(tokens, d_in, generator=g).to(DEVICE)
    delta = torch.full((tokens, sum(outs)), float("nan"), device=DEVICE)
    config = None
    if rows:
        config = replace(pick_config(meta.num_chunks, len(outs), d_in, meta.chunk_size), shrink_rows=True, block_k=32)
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_dev, meta, config)
    assert plan is not None
    launch_shrink(plan, zero=delta)
    launch_expand(plan, delta)
    ref = torch.zeros_like(delta)
    add_lora(ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
    assert (token_slots < 0).all(1).any()  # some rows get no LoRA at all: they must read 0
    torch.testing.assert_close(delta, ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="contiguous"):
        launch_shrink(plan, zero=delta.t())


@pytest.mark.parametrize("launch_bound", [None, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk_size,rows", [(16, False), (64, False), (16, True), (16, "ahead")])
def test_storing_expand_writes_only_rows_with_an_adapter(launch_bound: int | None, layout: str,
                                                         chunk_size: int, rows: bool | str) -> None:
    """One adapter per token: the expand stores (`=`) into an unzeroed delta. Rows of tokens with
    an adapter match the reference, a slot's untargeted slice (rank 0) included, which must read 0;
    rows without one keep what was there (NaN here), and `meta.has_lora` names exactly the others.
    Decode-sized (16) and prefill-sized (64) chunks, both B layouts; the expand a row at a time,
    and with its next tile loaded ahead."""
    from lorafleet.kernels.lora.config import pick_config
    from lorafleet.kernels.lora.launch import launch_expand, launch_shrink, plan_lora_triton

    g = torch.Generator().manual_seed(21)
    tokens, slots, d_in, outs = 40, 5, 48, [700, 300]
    ranks = [[8, 16, 0, 4, 16], [16, 1, 8, 0, 16]]
    lora_a, lora_b = make_weights(g, slots, 16, d_in, outs, ranks, torch.float32, DEVICE, layout)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    token_slots = torch.randint(-1, slots, (tokens, 1), generator=g, dtype=torch.int32)
    assert (token_slots == -1).any() and (token_slots == 2).any() and (token_slots == 3).any()
    meta = build_lora_meta(token_slots, torch.rand(tokens, 1, generator=g) + 0.5, slots, DEVICE, chunk_size)
    if launch_bound is not None:
        meta.launch_chunks = max(launch_bound, meta.num_chunks)
    x = torch.randn(tokens, d_in, generator=g).to(DEVICE)
    delta = torch.full((tokens, sum(outs)), float("nan"), device=DEVICE)
    config = None
    if rows == "ahead":  # 4 tiles of 64 columns a program: 700 ends inside the third
        config = replace(pick_config(meta.num_chunks, len(outs), d_in, chunk_size), block_n=64, n_per_prog=256,
                         expand_ahead=True)
    elif rows:  # 256 columns a program: 700 ends inside a tile
        config = replace(pick_config(meta.num_chunks, len(outs), d_in, chunk_size), expand_rows=True, expand_ahead=False,
                         block_n=256, n_per_prog=256)
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_dev, meta, config)
    assert plan is not None
    launch_shrink(plan)
    launch_expand(plan, delta, store=True)
    ref = torch.zeros_like(delta)
    add_lora(ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
    has = token_slots[:, 0] >= 0
    assert meta.has_lora.cpu().tolist() == has.int().tolist()
    torch.testing.assert_close(delta[has.to(DEVICE)], ref[has.to(DEVICE)], **TOL[torch.float32])
    assert delta[~has.to(DEVICE)].isnan().all()


def test_storing_expand_refuses_what_it_cannot_do() -> None:
    """k > 1 needs the atomic add into a zeroed delta; a zeroing shrink is for an adding expand."""
    from lorafleet.kernels.lora.launch import launch_expand, launch_shrink, plan_lora_triton

    g = torch.Generator().manual_seed(22)
    tokens, slots, d_in, outs = 8, 3, 16, [16]
    lora_a, lora_b = make_weights(g, slots, 16, d_in, outs, [[16] * slots], torch.float32, DEVICE)
    ranks_dev = torch.full((1, slots), 16, dtype=torch.int32, device=DEVICE)
    x = torch.randn(tokens, d_in, generator=g).to(DEVICE)
    delta = torch.zeros(tokens, 16, device=DEVICE)
    two = build_lora_meta(torch.randint(0, slots, (tokens, 2), generator=g), torch.ones(tokens, 2), slots, DEVICE)
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_dev, two)
    launch_shrink(plan)
    with pytest.raises(ValueError, match="one adapter per token"):
        launch_expand(plan, delta, store=True)
    one = build_lora_meta(torch.randint(0, slots, (tokens, 1), generator=g), torch.ones(tokens, 1), slots, DEVICE)
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_dev, one)
    launch_shrink(plan, zero=delta)
    with pytest.raises(ValueError, match="does not zero"):
        launch_expand(plan, delta, store=True)

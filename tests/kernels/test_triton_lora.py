"""Triton LoRA kernels against `add_lora_reference`.

Without CUDA the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), on
small shapes in fp32 / fp16. With CUDA the same cases run compiled on the GPU; the `@pytest.mark.gpu`
cases are in test_triton_lora_gpu.py.
Every case runs both B layouts (out-major, and rank-major as the slot pool stores it).
"""

from __future__ import annotations

import os
from dataclasses import replace

if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from lorafleet.kernels.lora_ops import (
    add_lora,
    build_lora_meta,
    lora_b_layout,
    new_lora_b,
)
from lorafleet.kernels.triton_lora import LoraKernelConfig, add_lora_triton

LAYOUTS = ["out_major", "rank_major"]

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def make_weights(
    g: torch.Generator,
    slots: int,
    r_max: int,
    d_in: int,
    outs: list[int],
    ranks: list[list[int]],
    dtype,
    device,
    layout: str = "out_major",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stacked slot weights; the padding past each slot's true rank is NaN, so reading it shows.

    layout "rank_major": B in `new_lora_b` memory (the slot pool's), same values.
    """
    lora_a, lora_b = [], []
    for out, slice_ranks in zip(outs, ranks):
        a = torch.randn(slots, r_max, d_in, generator=g) / d_in**0.5
        b = torch.randn(slots, out, r_max, generator=g) / r_max**0.5
        for slot, r in enumerate(slice_ranks):
            a[slot, r:] = float("nan")
            b[slot, :, r:] = float("nan")
        lora_a.append(a.to(device=device, dtype=dtype))
        if layout == "rank_major":
            stored = new_lora_b(slots, out, r_max, device=device, dtype=dtype)
            stored.copy_(b)
            assert lora_b_layout(stored) == "rank_major"
            lora_b.append(stored)
        else:
            lora_b.append(b.to(device=device, dtype=dtype))
    return lora_a, lora_b


def run_both(
    seed: int,
    tokens: int,
    k: int,
    d_in: int,
    outs: list[int],
    ranks: list[list[int]],
    token_slots: torch.Tensor,
    dtype: torch.dtype,
    chunk_size: int | None = None,
    config: LoraKernelConfig | None = None,
    device: str = DEVICE,
    layout: str = "out_major",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y before, y after the reference, y after Triton)."""
    g = torch.Generator().manual_seed(seed)
    slots, r_max = len(ranks[0]), max(1, max(max(r) for r in ranks))
    lora_a, lora_b = make_weights(g, slots, r_max, d_in, outs, ranks, dtype, device, layout)
    scales = torch.rand(tokens, k, generator=g) + 0.25
    meta = build_lora_meta(token_slots.to(torch.int32), scales, slots, device=device, chunk_size=chunk_size)
    x = torch.randn(tokens, d_in, generator=g).to(device=device, dtype=dtype)
    y0 = torch.randn(tokens, sum(outs), generator=g).to(device=device, dtype=dtype)  # poison: y is added to
    y_ref, y_tri = y0.clone(), y0.clone()
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=device)
    add_lora(y_ref, x, lora_a, lora_b, ranks, ranks_dev, meta, backend="torch")
    if config is None:
        add_lora(y_tri, x, lora_a, lora_b, ranks, ranks_dev, meta, backend="triton")
    else:
        add_lora_triton(y_tri, x, lora_a, lora_b, ranks_dev, meta, config=config)
    return y0, y_ref, y_tri


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def mapping(kind: str, g: torch.Generator, tokens: int, k: int, slots: int) -> torch.Tensor:
    if kind == "random_with_none":
        return torch.randint(-1, slots, (tokens, k), generator=g)
    if kind == "one_adapter":
        return (
            torch.full((tokens, k), slots - 1)
            if k == 1
            else torch.randperm(slots, generator=g)[:k].repeat(tokens, 1)
        )
    if kind == "each_token_own":
        return (torch.arange(tokens * k) % slots).reshape(tokens, k)
    if kind == "empty_segments":  # only the odd slots are used
        return 2 * torch.randint(0, slots // 2, (tokens, k), generator=g) + 1
    if kind == "all_none":
        return torch.full((tokens, k), -1)
    raise ValueError(kind)


# (case id, tokens, k, d_in, outs, ranks per slice, mapping, dtype, chunk_size, config)
CASES = [
    ("r1-k1-1slice", 5, 1, 40, [24], [[1, 1, 1, 1]], "random_with_none", torch.float32, None, None),
    ("r7-k1-fp16", 19, 1, 72, [40], [[7, 7, 7, 7]], "random_with_none", torch.float16, None, None),
    ("r8-one-adapter-chunks", 40, 1, 64, [33, 17], [[8, 8, 8]] * 2, "one_adapter", torch.float32, None, None),
    ("r16-each-token", 12, 1, 96, [70], [[16] * 12], "each_token_own", torch.float32, None, None),
    (
        "r64-qkv-fp16",
        9,
        1,
        80,
        [48, 16, 16],
        [[64, 64, 64]] * 3,
        "random_with_none",
        torch.float16,
        None,
        None,
    ),
    (
        "mixed-rank-pool64",
        23,
        1,
        100,
        [50, 30],
        [[1, 7, 8, 16, 64, 0], [64, 0, 16, 8, 7, 1]],
        "random_with_none",
        torch.float32,
        None,
        None,
    ),
    (
        "rank0-slice",
        14,
        2,
        56,
        [24, 24, 8],
        [[16, 8, 16, 8], [0, 8, 0, 8], [16, 0, 0, 16]],
        "random_with_none",
        torch.float16,
        None,
        None,
    ),
    (
        "k2-scales",
        21,
        2,
        64,
        [40, 40],
        [[8, 16, 8, 16, 8]] * 2,
        "random_with_none",
        torch.float32,
        None,
        None,
    ),
    ("k3-one-adapter-each", 11, 3, 48, [32], [[16, 16, 16, 16]], "one_adapter", torch.float32, None, None),
    (
        "k3-empty-segments",
        17,
        3,
        40,
        [20, 12],
        [[8] * 8, [16] * 8],
        "empty_segments",
        torch.float16,
        None,
        None,
    ),
    ("all-none", 6, 2, 32, [16], [[8, 8]], "all_none", torch.float32, None, None),
    (
        "chunk32-split3",
        45,
        1,
        200,
        [36],
        [[16, 7, 64]],
        "random_with_none",
        torch.float32,
        32,
        LoraKernelConfig(split_k=3, block_k=32, block_n=16, n_per_prog=48),
    ),
    (
        "n-loop-k2",
        30,
        2,
        56,
        [100, 36],
        [[16, 8, 0, 64, 1]] * 2,
        "random_with_none",
        torch.float16,
        None,
        LoraKernelConfig(split_k=2, block_k=32, block_n=32, n_per_prog=64),
    ),
    ("chunk64-prefill", 70, 1, 72, [24, 24], [[8, 16]] * 2, "one_adapter", torch.float16, 64, None),
    # The shrink a row at a time (ROWS): a row a chunk, then chunks of many rows with k = 2 and empty
    # K splits (K tile 64 over 40 features in 3 splits), three slices with a rank-0 one.
    (
        "rows-each-token",
        12,
        1,
        96,
        [70],
        [[16, 7, 16, 1] * 3],
        "each_token_own",
        torch.float32,
        None,
        LoraKernelConfig(split_k=2, block_k=32, block_n=16, n_per_prog=32, shrink_rows=True),
    ),
    (
        "rows-many-k2-empty-splits",
        21,
        2,
        40,
        [24, 8, 8],
        [[8, 16, 8, 16, 8], [0, 16, 8, 16, 0], [16, 16, 1, 16, 16]],
        "random_with_none",
        torch.float16,
        None,
        LoraKernelConfig(split_k=3, block_k=64, block_n=16, n_per_prog=32, shrink_rows=True),
    ),
    # The expand a row at a time too (one B tile a program): a row a chunk; then chunks of many rows
    # with k = 2 (atomic adds), a rank-0 slice and columns that do not fill the last tile.
    (
        "expand-rows-each-token",
        12,
        1,
        96,
        [70, 20],
        [[16, 7, 16, 1] * 3, [0, 16, 8, 64] * 3],
        "each_token_own",
        torch.float32,
        None,
        LoraKernelConfig(split_k=2, block_k=32, block_n=32, n_per_prog=32, shrink_rows=True, expand_rows=True),
    ),
    (
        "expand-rows-many-k2",
        21,
        2,
        40,
        [24, 8, 40],
        [[8, 16, 8, 16, 8], [0, 16, 8, 16, 0], [16, 16, 1, 16, 16]],
        "random_with_none",
        torch.float16,
        None,
        LoraKernelConfig(split_k=3, block_k=32, block_n=16, n_per_prog=16, expand_rows=True),
    ),
    (
        "expand-rows-many-k1",
        30,
        1,
        56,
        [100, 36],
        [[16, 8, 0, 64, 1]] * 2,
        "random_with_none",
        torch.float32,
        None,
        LoraKernelConfig(split_k=2, block_k=32, block_n=64, n_per_prog=64, expand_rows=True),
    ),
]

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "case_id,tokens,k,d_in,outs,ranks,kind,dtype,chunk_size,config",
    CASES,
    ids=[c[0] for c in CASES],
)
def test_triton_matches_reference(
    case_id, tokens, k, d_in, outs, ranks, kind, dtype, chunk_size, config, layout
) -> None:
    g = torch.Generator().manual_seed(tokens + 7 * k + d_in)
    token_slots = mapping(kind, g, tokens, k, len(ranks[0]))
    _, y_ref, y_tri = run_both(
        tokens, tokens, k, d_in, outs, ranks, token_slots, dtype, chunk_size, config, layout=layout
    )
    assert not torch.isnan(y_tri).any()
    torch.testing.assert_close(y_tri.float(), y_ref.float(), **TOL[dtype])


def test_pick_config_runs_the_shrink_a_row_at_a_time_only_where_asked(monkeypatch) -> None:
    """SHRINK_ROWS: for a step of one-pair chunks, decode-sized only, with its K tile and warps;
    never while it is empty."""
    from lorafleet.kernels import triton_lora

    cfg = triton_lora.pick_config(64, 3, 4096, 16, one_pair=True)
    assert (cfg.shrink_rows, cfg.block_k, cfg.shrink_warps) == (True, *triton_lora.SHRINK_ROWS)
    assert not triton_lora.pick_config(64, 3, 4096, 16).shrink_rows  # chunks of several pairs
    assert not triton_lora.pick_config(64, 3, 4096, 64, one_pair=True).shrink_rows  # prefill chunks
    monkeypatch.setattr(triton_lora, "SHRINK_ROWS", ())
    assert not triton_lora.pick_config(64, 3, 4096, 16, one_pair=True).shrink_rows


def test_pick_config_runs_the_expand_a_row_at_a_time_only_where_asked(monkeypatch) -> None:
    """EXPAND_ROWS: likewise, one B tile of its width a program, with its warps."""
    from lorafleet.kernels import triton_lora

    monkeypatch.setattr(triton_lora, "EXPAND_ROWS", (256, 8))
    cfg = triton_lora.pick_config(64, 3, 4096, 16, one_pair=True)
    assert (cfg.expand_rows, cfg.block_n, cfg.n_per_prog, cfg.expand_warps) == (True, 256, 256, 8)
    assert cfg.expand_maxnreg is None  # no register cap unless EXPAND_ROWS names one
    monkeypatch.setattr(triton_lora, "EXPAND_ROWS", (256, 8, 168))
    assert triton_lora.pick_config(64, 3, 4096, 16, one_pair=True).expand_maxnreg == 168
    assert triton_lora.pick_config(64, 3, 4096, 16).expand_maxnreg is None  # the tl.dot expand: never
    assert not triton_lora.pick_config(64, 3, 4096, 16).expand_rows  # chunks of several pairs
    assert not triton_lora.pick_config(64, 3, 4096, 64, one_pair=True).expand_rows  # prefill chunks
    monkeypatch.setattr(triton_lora, "EXPAND_ROWS", ())
    assert not triton_lora.pick_config(64, 3, 4096, 16, one_pair=True).expand_rows


@pytest.mark.parametrize("bad,says", [
    (dict(block_k=8), "block_k must be a power of two >= 16"), (dict(block_k=48), "block_k"),
    (dict(block_n=8), "block_n"), (dict(block_n=96), "block_n"), (dict(shrink_warps=3), "shrink_warps"),
    (dict(expand_warps=0), "expand_warps"), (dict(split_k=0), ">= 1"), (dict(n_per_prog=0), ">= 1"),
    (dict(num_stages=0), ">= 1"), (dict(block_k=32.0), "block_k must be an int"),
    (dict(split_k=True), "split_k must be an int"), (dict(expand_rows=True), "n_per_prog == block_n"),
    (dict(expand_maxnreg=16), "expand_maxnreg"), (dict(expand_maxnreg=256), "expand_maxnreg"),
    (dict(expand_maxnreg=168.0), "expand_maxnreg"),
])
def test_kernel_config_refuses_what_the_compiler_would(bad: dict, says: str) -> None:
    """A K tile below 16 runs under the interpreter but fails to compile for the GPU (`tl.dot`
    needs K >= 16; seen on the H200): the config says so itself, as for other impossible knobs."""
    fields = dict(split_k=2, block_k=32, block_n=32, n_per_prog=64)
    with pytest.raises(ValueError, match=says):
        LoraKernelConfig(**{**fields, **bad})
    LoraKernelConfig(**fields)  # the same without the bad knob is fine


def test_one_pair_chunks_from_the_counts_unless_set() -> None:
    """A meta judges its chunks from its own counts: more than ONE_PAIR_MIN_CHUNKS of them, at most
    ONE_PAIR_CHUNKS[0] pairs each on average, none longer than ONE_PAIR_CHUNKS[1]; `one_pair`,
    which a decode graph sets from the step, overrides that."""
    from lorafleet.kernels.lora_ops import ONE_PAIR_CHUNKS, ONE_PAIR_MIN_CHUNKS

    def meta(slots: list[int]):
        return build_lora_meta(torch.tensor(slots, dtype=torch.int32)[:, None], torch.ones(len(slots), 1), 64, DEVICE)

    assert ONE_PAIR_MIN_CHUNKS == 16 and ONE_PAIR_CHUNKS == (1.5, 2)
    each = meta(list(range(32)))  # 32 chunks of one
    few = meta(list(range(16)))  # 16 chunks of one: not more than ONE_PAIR_MIN_CHUNKS
    twos = meta([t // 2 for t in range(64)])  # 32 chunks of two: 2 on average
    long = meta(list(range(30)) + [40] * 10)  # 31 chunks, 1.3 on average, but one of 10
    mixed = meta(list(range(24)) + [30, 30, 31, 31, 32, 32])  # 27 chunks, 1.1 on average, none over 2
    none = meta([-1] * 32)
    assert each.one_pair_chunks and mixed.one_pair_chunks
    assert not any(m.one_pair_chunks for m in (few, twos, long, none))
    twos.one_pair = True
    each.one_pair = False
    assert twos.one_pair_chunks and not each.one_pair_chunks


def test_mixed_b_layouts_fall_back_to_a_copy() -> None:
    """One rank-major and one out-major slice: still correct (the kernel gets contiguous copies)."""
    g = torch.Generator().manual_seed(5)
    ranks = [[8, 3, 0], [16, 16, 1]]
    lora_a, lora_b = make_weights(g, 3, 16, 40, [24, 20], ranks, torch.float32, DEVICE, "rank_major")
    lora_b[1] = lora_b[1].contiguous()
    meta = build_lora_meta(torch.randint(-1, 3, (9, 1), generator=g).int(), torch.rand(9, 1), 3, device=DEVICE)
    x, y = torch.randn(9, 40, generator=g).to(DEVICE), torch.randn(9, 44, generator=g).to(DEVICE)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    y_ref, y_tri = y.clone(), y.clone()
    add_lora(y_ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
    add_lora_triton(y_tri, x, lora_a, lora_b, ranks_dev, meta)
    torch.testing.assert_close(y_tri, y_ref, **TOL[torch.float32])


def test_triton_rejects_mismatched_meta() -> None:
    g = torch.Generator().manual_seed(0)
    lora_a, lora_b = make_weights(g, 2, 8, 16, [8], [[8, 8]], torch.float32, DEVICE)
    meta = build_lora_meta(torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1), 2, device=DEVICE)
    x, y = torch.randn(4, 16, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError):
        add_lora(
            y,
            x,
            lora_a,
            lora_b,
            [[8, 8]],
            torch.tensor([[8, 8]], dtype=torch.int32, device=DEVICE),
            meta,
            "triton",
        )


@pytest.mark.parametrize("k", [1, 2])
def test_launch_bound_on_chunks(k: int) -> None:
    """A graph launches grids of its chunk class, not max_chunks: a meta captured that way gives
    the reference's result for any step of the class, and `copy_` refuses a step with more chunks."""
    g = torch.Generator().manual_seed(11)
    tokens, slots, d_in, outs = 40, 12, 48, [24, 8]
    ranks = [[8, 16, 1, 7, 0, 16, 8, 8, 16, 4, 8, 16], [16] * slots]
    lora_a, lora_b = make_weights(g, slots, 16, d_in, outs, ranks, torch.float32, DEVICE, "rank_major")
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    x = torch.randn(tokens, d_in, generator=g).to(DEVICE)

    def step(adapters: int):
        slots_t = torch.randint(0, adapters, (tokens, k), generator=g, dtype=torch.int32)
        if k > 1:
            slots_t[:, 1] = torch.where(slots_t[:, 1] == slots_t[:, 0], -1, slots_t[:, 1])
        return build_lora_meta(slots_t, torch.rand(tokens, k, generator=g) + 0.5, slots, DEVICE)

    static = step(3)
    bound = static.launch_chunks = 4 * k
    assert 3 <= static.num_chunks <= bound < static.max_chunks
    for adapters in (1, 3, 5):
        meta = step(adapters)
        if meta.num_chunks > bound:
            with pytest.raises(ValueError, match=f"launches cover {bound}"):
                static.copy_(meta)
            continue
        static.copy_(meta)
        y_ref, y_tri = torch.zeros(tokens, sum(outs), device=DEVICE), torch.zeros(tokens, sum(outs), device=DEVICE)
        add_lora(y_ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
        add_lora_triton(y_tri, x, lora_a, lora_b, ranks_dev, static)
        torch.testing.assert_close(y_tri, y_ref, **TOL[torch.float32])
    too_many = step(slots)
    assert too_many.num_chunks > bound
    with pytest.raises(ValueError, match=f"launches cover {bound}"):
        static.copy_(too_many)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("launch_bound", [None, 8])
def test_shrink_zeroes_the_delta_it_expands_into(k: int, launch_bound: int | None, rows: bool) -> None:
    """The side path's delta is not memset: the shrink's programs (padding chunks' too) zero it,
    then the expand accumulates into it. A NaN-poisoned buffer, tokens without an adapter, a slot
    that leaves a slice untargeted (rank 0), and more elements than one block per program; with
    the shrink a row at a time too."""
    from lorafleet.kernels.triton_lora import launch_expand, launch_shrink, pick_config, plan_lora_triton

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
@pytest.mark.parametrize("chunk_size,rows", [(16, False), (64, False), (16, True)])
def test_storing_expand_writes_only_rows_with_an_adapter(launch_bound: int | None, layout: str,
                                                         chunk_size: int, rows: bool) -> None:
    """One adapter per token: the expand stores (`=`) into an unzeroed delta. Rows of tokens with
    an adapter match the reference, a slot's untargeted slice (rank 0) included, which must read 0;
    rows without one keep what was there (NaN here), and `meta.has_lora` names exactly the others.
    Decode-sized (16) and prefill-sized (64) chunks, both B layouts; the expand a row at a time."""
    from lorafleet.kernels.triton_lora import launch_expand, launch_shrink, pick_config, plan_lora_triton

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
    if rows:  # 256 columns a program: 700 ends inside a tile
        config = replace(pick_config(meta.num_chunks, len(outs), d_in, chunk_size), expand_rows=True, block_n=256,
                         n_per_prog=256)
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


def test_plan_refuses_a_launch_bound_below_the_chunks() -> None:
    """Chunks past the launch bound would be skipped (their tokens left without LoRA, or with an
    unwritten delta): the plan refuses such a meta on the host."""
    from lorafleet.kernels.triton_lora import plan_lora_triton

    g = torch.Generator().manual_seed(23)
    tokens, slots, d_in = 20, 4, 16
    lora_a, _ = make_weights(g, slots, 16, d_in, [16], [[16] * slots], torch.float32, DEVICE)
    meta = build_lora_meta(torch.arange(tokens, dtype=torch.int32).remainder(slots).unsqueeze(1),
                           torch.ones(tokens, 1), slots, DEVICE)
    assert meta.num_chunks == slots
    meta.launch_chunks = slots - 1
    with pytest.raises(ValueError, match="launches cover 3"):
        plan_lora_triton(torch.randn(tokens, d_in, device=DEVICE), lora_a, [torch.zeros(slots, 16, 16, device=DEVICE)],
                         torch.full((1, slots), 16, dtype=torch.int32, device=DEVICE), meta)


def test_storing_expand_refuses_what_it_cannot_do() -> None:
    """k > 1 needs the atomic add into a zeroed delta; a zeroing shrink is for an adding expand."""
    from lorafleet.kernels.triton_lora import launch_expand, launch_shrink, plan_lora_triton

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


# Compiles both kernels for sm_90 (ptxas included) without a GPU (tests/kernels/hopper_compile.py),
# in every mode a launch picks: what the interpreter lets through (a value whose type differs
# between the branches of a constexpr `if`, an op sm_90 lacks) fails here.
HOPPER_COMPILE = r"""
import re

from lorafleet.kernels import lora_kernels as tk

i32, p = "i32", "*bf16"
ptrs = {n: "*i32" for n in ("ranks_ptr", "chunk_slot_ptr", "chunk_start_ptr", "chunk_end_ptr", "sorted_token_ptr")}
shrink = {"x_ptr": p, "a0_ptr": p, "a1_ptr": p, "a2_ptr": p, **ptrs, "part_ptr": "*fp32", "zero_ptr": p,
          **{n: i32 for n in ("K", "K_PER_SPLIT", "ZERO_NUMEL", "stride_xt", "stride_as", "stride_ar", "stride_rs",
                              "stride_ps", "stride_pm")}}
expand = {"y_ptr": p, "b0_ptr": p, "b1_ptr": p, "b2_ptr": p, **ptrs, "sorted_scale_ptr": "*fp32",
          "part_ptr": "*fp32", **{n: i32 for n in ("OUT0", "OUT1", "OUT2", "GROUPS0", "GROUPS1", "SPLIT_K",
                                                   "stride_yt", "stride_rs", "stride_ps", "stride_pm")}}
for pdl in (False, True):
    for zero, rows in ((False, False), (True, False), (False, True), (True, True)):
        compile_(tk._lora_shrink_kernel, shrink, dict(R_MAX=16, R_PAD=16, R_BLOCKS=1, BLOCK_M=16, BLOCK_K=128, BLOCK_RANK=16,
                                   UPCAST=False, IEEE=False, PDL=pdl, ZERO=zero, ZERO_BLOCK=1024, ROWS=rows),
                 stages=3)
    # (ATOMIC, Y_EARLY, STORE): k > 1; y read before the wait; y read after it (the shrink zeroed
    # it); the storing expand.
    for atomic, early, store in ((True, False, False), (False, True, False), (False, False, False),
                                 (False, False, True)):
        for rank_major, rows in ((False, False), (True, False), (False, True), (True, True)):
            k = compile_(tk._lora_expand_kernel, expand,
                         dict(R_MAX=16, R_PAD=16, R_BLOCK=16, B_RANK_MAJOR=rank_major, BLOCK_M=16,
                              BLOCK_N=256 if rows else 128, N_PER_PROG=256 if rows else 512, UPCAST=False,
                              IEEE=False, ATOMIC=atomic, PDL=pdl, Y_EARLY=early, STORE=store, ROWS=rows), stages=3)
            ptx = k.asm["ptx"]
            assert bool(re.search(r"\b(atom|red)\.global", ptx)) == atomic, "atomics only for k > 1"
            # PDL: every program waits for the shrink, those with nothing to do too (the kernels
            # behind the expand may take its completion for the shrink's)
            assert ptx.count("griddepcontrol.wait") >= (2 if pdl else 0) and (pdl or "griddepcontrol" not in ptx)
# The row-at-a-time modes' rank tiles follow the step's rank bound, below tl.dot's 16 too: their
# tl.dot paths sit in `else` branches, not after a `return`, where the code generator still visits
# them (this Triton refuses the expand's K below 16 there; Triton 3.3-3.4 the shrink's N too).
for r_tile in (1, 8):
    compile_(tk._lora_shrink_kernel, shrink, dict(R_MAX=64, R_PAD=16, R_BLOCKS=1, BLOCK_M=16, BLOCK_K=256,
                                                  BLOCK_RANK=r_tile, UPCAST=False, IEEE=False, PDL=True, ZERO=False,
                                                  ZERO_BLOCK=1024, ROWS=True), stages=3)
    compile_(tk._lora_expand_kernel, expand, dict(R_MAX=64, R_PAD=16, R_BLOCK=r_tile, B_RANK_MAJOR=True, BLOCK_M=16,
                                                  BLOCK_N=512, N_PER_PROG=512, UPCAST=False, IEEE=False, ATOMIC=False,
                                                  PDL=True, Y_EARLY=True, STORE=False, ROWS=True), warps=2, stages=3)
# The row expand under a register cap (LoraKernelConfig.expand_maxnreg): ptxas is told so.
k = compile_(tk._lora_expand_kernel, expand, dict(R_MAX=16, R_PAD=16, R_BLOCK=16, B_RANK_MAJOR=True, BLOCK_M=16,
                                                  BLOCK_N=512, N_PER_PROG=512, UPCAST=False, IEEE=False, ATOMIC=False,
                                                  PDL=True, Y_EARLY=True, STORE=False, ROWS=True), warps=2, stages=3,
             maxnreg=168)
assert ".maxnreg 168" in k.asm["ptx"], "the cap reaches the PTX"
print("ok")
"""


def test_kernels_compile_for_hopper() -> None:
    """Both kernels compile to sm_90 cubins in every launch mode (no GPU needed); skipped where
    this Triton lacks the compile API."""
    from tests.kernels.hopper_compile import run_hopper_compile

    run_hopper_compile(HOPPER_COMPILE)


ROWS_CONFIG = LoraKernelConfig(split_k=2, block_k=32, block_n=64, n_per_prog=64, shrink_rows=True, expand_rows=True,
                               expand_maxnreg=168)


@pytest.mark.parametrize("config", [None, ROWS_CONFIG], ids=["picked", "rows"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [1, 2])
def test_rank_bound_sizes_tiles_to_the_step_not_the_pool(layout: str, k: int, config) -> None:
    """A rank-64 pool whose active slots have ranks <= 1, 3, 7 or 16: with meta.rank_bound set to
    that bound the kernels compute rank-bound tiles (the row-at-a-time modes: 1, 4, 8 and 16 rows)
    and still match the reference."""
    g = torch.Generator().manual_seed(11 + k)
    for bound, ranks in ((1, [[1, 0, 1, 1], [1, 1, 0, 1]]), (3, [[3, 1, 0, 2], [2, 3, 3, 0]]),
                         (7, [[7, 3, 0, 1], [5, 7, 2, 0]]), (16, [[16, 9, 1, 16], [8, 16, 0, 3]])):
        slots = len(ranks[0])
        lora_a, lora_b = make_weights(g, slots, 64, 48, [40, 24], ranks, torch.float32, DEVICE, layout)
        token_slots = mapping("random_with_none", g, 21, k, slots)
        meta = build_lora_meta(token_slots.to(torch.int32), torch.rand(21, k, generator=g) + 0.25, slots, device=DEVICE)
        meta.rank_bound = bound
        x = torch.randn(21, 48, generator=g).to(DEVICE)
        y = torch.randn(21, 64, generator=g).to(DEVICE)
        ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
        y_ref, y_tri = y.clone(), y.clone()
        add_lora(y_ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
        add_lora_triton(y_tri, x, lora_a, lora_b, ranks_dev, meta, config=config)
        torch.testing.assert_close(y_tri, y_ref, **TOL[torch.float32])

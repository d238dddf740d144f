"""Triton LoRA kernels against `add_lora_reference`.

Without CUDA the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), on
small shapes in fp32 / fp16. With CUDA the same cases run compiled on the GPU; the `@pytest.mark.gpu`
cases are in test_triton_lora_gpu.py, launch parameters in test_triton_lora_config.py, the side
path's delta in test_triton_lora_delta.py.
Every case runs both B layouts (out-major, and rank-major as the slot pool stores it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lorafleet.kernels.lora.config import LoraKernelConfig
from lorafleet.kernels.lora.launch import add_lora_triton
from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.kernels.lora.ops import add_lora
from tests.kernels.lora_cases import DEVICE, LAYOUTS, TOL, make_weights, mapping, run_both

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
    # The expand's next tile loaded ahead (expand_ahead): 3-4 tiles a program, the last one partial
    # and one past each slice's end; adding into y with k = 1, then atomically with k = 2 and
    # column groups that end inside a tile (40 columns, 16 a tile).
    (
        "ahead-k1",
        33,
        1,
        40,
        [70, 36],
        [[16, 8, 0, 16]] * 2,
        "random_with_none",
        torch.float16,
        None,
        LoraKernelConfig(split_k=2, block_k=32, block_n=16, n_per_prog=64, expand_ahead=True),
    ),
    (
        "ahead-k2",
        21,
        2,
        48,
        [50],
        [[16, 7, 16, 8]],
        "random_with_none",
        torch.float32,
        None,
        LoraKernelConfig(split_k=3, block_k=32, block_n=16, n_per_prog=40, expand_ahead=True),
    ),
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
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(case, layout) -> None:
    check_case(case, case[-1], layout)


def check_case(case: tuple, config: LoraKernelConfig | None, layout: str = "out_major") -> None:
    """One of CASES through the Triton path (with `config`) against the torch reference."""
    _case_id, tokens, k, d_in, outs, ranks, kind, dtype, chunk_size, _ = case
    g = torch.Generator().manual_seed(tokens + 7 * k + d_in)
    token_slots = mapping(kind, g, tokens, k, len(ranks[0]))
    _, y_ref, y_tri = run_both(
        tokens, tokens, k, d_in, outs, ranks, token_slots, dtype, chunk_size, config, layout=layout
    )
    assert not torch.isnan(y_tri).any()
    torch.testing.assert_close(y_tri.float(), y_ref.float(), **TOL[dtype])

# Both ways the expand can sum the shrink's K splits (`LoraKernelConfig.split_sum`), on the cases of
# several splits, tl.dot and row-at-a-time expands both; 5 splits of a short K leave some splits
# empty (their partials are zeros).
SPLIT_CASES = [c for c in CASES if c[-1] is not None and c[-1].split_k > 1]
# (split_sum, split count; None: the case's own). The unrolled sum at the case's own count is the
# case's config as given (split_sum's default), which test_triton_matches_reference runs.
SPLIT_SUM_RUNS = [("loop", None), ("loop", 5), ("unroll", 5)]
assert all(c[-1].split_sum == "unroll" for c in SPLIT_CASES)


@pytest.mark.parametrize("split_sum,splits", SPLIT_SUM_RUNS, ids=["loop-as-given", "loop-five", "unroll-five"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_every_split_sum_matches_reference(case, split_sum, splits) -> None:
    config = case[-1]
    check_case(case, replace(config, split_sum=split_sum, split_k=splits or config.split_k))


# The cases with a config of their own (the others take pick_config's, which has meta_round on as
# the tuning's meta_round is, and run so in test_triton_matches_reference).
META_CASES = [c for c in CASES if c[-1] is not None]


@pytest.mark.parametrize("case", META_CASES, ids=[c[0] for c in META_CASES])
def test_chunk_meta_in_one_round_matches_reference(case) -> None:
    """The kernels' early exit on the chunk's slot, start and end together (`meta_round`): padding
    chunks, empty segments and tokens without an adapter come out as without it."""
    check_case(case, replace(case[-1], meta_round=True))


@pytest.mark.parametrize(
    "split_sum,meta_round,tokens,expect", [("unroll", False, 16, 3), ("loop", True, 16, 0), ("unroll", True, 320, 0)],
    ids=["unrolled", "loop", "past-the-bytes-bound"])
def test_launches_hand_the_kernels_the_config(split_sum, meta_round, tokens, expect, monkeypatch) -> None:
    """What the two launches pass for the config's split sum and chunk-meta round: the split count
    when unrolled, 0 for the loop and for a launch whose partial reads pass tuning.unroll_max_partial_bytes
    (320 tokens on 4 adapters: 20 chunks x 256 column groups x 3 splits x 16 rows x 16 ranks, 15 MiB);
    META_ROUND to both."""
    from lorafleet.kernels.lora import launch as triton_lora

    seen: dict[str, dict] = {}

    class Spy:  # stands in for a @triton.jit kernel: kernel[grid](*args, **constexprs)
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.__setitem__(self.name, kw)

    monkeypatch.setattr(triton_lora, "_lora_shrink_kernel", Spy("shrink"))
    monkeypatch.setattr(triton_lora, "_lora_expand_kernel", Spy("expand"))
    g = torch.Generator().manual_seed(0)
    lora_a, lora_b = make_weights(g, 4, 16, 64, [4096], [[16, 16, 16, 16]], torch.float32, "cpu", "rank_major")
    slots = (torch.arange(tokens) % 4).reshape(tokens, 1).to(torch.int32)
    meta = build_lora_meta(slots, torch.ones(tokens, 1), 4, device="cpu", chunk_size=16)
    config = LoraKernelConfig(split_k=3, block_k=32, block_n=16, n_per_prog=16, split_sum=split_sum,
                              meta_round=meta_round)
    add_lora_triton(torch.zeros(tokens, 4096), torch.randn(tokens, 64), lora_a, lora_b,
                    torch.full((1, 4), 16, dtype=torch.int32), meta, config=config)
    assert seen["expand"]["SPLIT_SUM"] == expect
    assert seen["shrink"]["META_ROUND"] is meta_round and seen["expand"]["META_ROUND"] is meta_round


def test_split_sum_codes() -> None:
    """The expand's SPLIT_SUM constexpr: 0 (the loop) for the loop, for one split, past the unroll
    bound and for launches that would read more partials than tuning.unroll_max_partial_bytes; else
    the split count."""
    from lorafleet.kernels.lora.config import partial_read_bytes, split_sum_code
    from lorafleet.kernels.lora.tuning import active_tuning

    MAX_UNROLLED_SPLITS = active_tuning().max_unrolled_splits
    UNROLL_MAX_PARTIAL_BYTES = active_tuning().unroll_max_partial_bytes

    assert [split_sum_code("loop", n) for n in (1, 8, 28)] == [0, 0, 0]
    assert [split_sum_code("unroll", n) for n in (1, 3, 28, MAX_UNROLLED_SPLITS + 1)] == [0, 3, 28, 0]
    # gate/up at 256 tokens on one adapter: 16 chunks x 112 column groups x 8 splits x 16 rows x 16 ranks
    assert partial_read_bytes(16, 112, 8, 16, 16) == 14_680_064 > UNROLL_MAX_PARTIAL_BYTES
    assert split_sum_code("unroll", 8, partial_read_bytes(16, 112, 8, 16, 16)) == 0
    assert split_sum_code("unroll", 8, partial_read_bytes(64, 16, 8, 16, 16)) == 8  # o at 256 tokens, 64 adapters
    with pytest.raises(ValueError, match="split_sum"):
        LoraKernelConfig(split_k=2, block_k=32, block_n=16, split_sum="tile")


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

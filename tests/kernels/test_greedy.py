"""The greedy pick (`kernels/sampling/greedy.py`): the Triton kernels against torch's argmax and isfinite.

Without CUDA the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on
small odd shapes; with CUDA compiled, plus the `@pytest.mark.gpu` cases: bf16 at the seed
vocabulary (100,000) for batch buckets 1 … 64, and the pick captured in a CUDA graph.

The oracle is torch itself: for a row without NaN the token is `torch.argmax` of the row (ties:
the first index) and `shown` is that token where `torch.isfinite` holds for the whole row, else -1.
Rows with NaN (argmax semantics differ: torch counts NaN as the largest) are checked against the
stated rule, NaN as -inf, and must still give a valid vocabulary index.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.sampling.greedy import greedy_pick, greedy_pick_reference
from lorafleet.kernels.sampling.greedy_triton import launch_shape
from tests.kernels.hopper_compile import run_hopper_compile

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _oracle_check(logits: torch.Tensor, tokens: torch.Tensor, shown: torch.Tensor) -> None:
    rows, vocab = logits.shape
    assert tokens.dtype == shown.dtype == torch.int64 and tokens.shape == shown.shape == (rows,)
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    nan = logits.isnan().any(dim=-1)
    finite = logits.isfinite().all(dim=-1)
    want = logits.float().argmax(dim=-1)
    assert torch.equal(tokens[~nan], want[~nan])
    assert torch.equal(shown, torch.where(finite, tokens, -1))
    cleaned = logits.float().masked_fill(logits.isnan(), float("-inf"))
    assert torch.equal(tokens[nan], cleaned[nan].argmax(dim=-1))


def _poisoned(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with the special rows the engine can meet, where the batch has room for them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    specials = [
        lambda r: r.__setitem__(vocab // 2, float("nan")),  # an overflow's NaN
        lambda r: r.__setitem__(0, float("inf")),  # +inf: the argmax, but not finite
        lambda r: r.__setitem__(vocab - 1, float("-inf")),  # -inf alone: not finite either
        lambda r: r.fill_(float("-inf")),  # everything masked
        lambda r: r.fill_(float("nan")),  # everything NaN: token 0, shown -1
        lambda r: r.__setitem__(slice(None), r.max()),  # all tied: the first index
    ]
    for i, poison in enumerate(specials[: max(0, rows - 1)]):
        poison(x[i + 1])
    if vocab > 2:  # row 0: its maximum twice, far apart (other splits): the first one wins
        top = x[0].max()
        x[0, 1], x[0, vocab - 1] = top, top
    return x


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 7), (2, 1000), (3, 1025), (7, 4099), (16, 3001), (64, 2053)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_torch(rows, vocab, dtype):
    x = _poisoned(rows, vocab, dtype, seed=rows * 31 + vocab).to(DEVICE)
    tokens, shown = greedy_pick(x, "triton")
    _oracle_check(x, tokens, shown)
    ref = greedy_pick_reference(x)
    assert torch.equal(tokens, ref[0]) and torch.equal(shown, ref[1])


def test_rows_with_a_stride_and_no_rows():
    """A view of the first `vocab` columns of a wider buffer (a graph's output slice), and N = 0."""
    wide = torch.randn(5, 1500, device=DEVICE)
    wide[:, 1100:] = 1e4  # past the vocabulary: must not be read
    x = wide[:, :1100]
    tokens, shown = greedy_pick(x, "triton")
    _oracle_check(x, tokens, shown)
    empty = greedy_pick(torch.empty(0, 10, device=DEVICE), "triton")
    assert empty[0].shape == empty[1].shape == (0,)


def test_launch_shape_covers_the_row():
    """Every (rows, vocab): the splits cover the row, tiles never wider than a split needs."""
    for rows in (1, 2, 3, 16, 64, 256):
        for vocab in (1, 5, 1024, 1025, 32000, 100000, 151936):
            splits, span, block = launch_shape(rows, vocab)
            assert splits & (splits - 1) == 0 and 1 <= splits <= 64 and span % 16 == 0
            assert splits * span >= vocab and block <= 2048 and block & (block - 1) == 0
            assert block >= min(span, 2048)


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.float32), torch.zeros(2, 3, dtype=torch.int64),
                                 torch.zeros(2, 0), torch.zeros(3, 2).t()])
def test_bad_input_is_a_clear_error(bad):
    with pytest.raises(ValueError):
        greedy_pick(bad, "triton")
    with pytest.raises(ValueError):
        greedy_pick(bad)


def test_unknown_backend():
    with pytest.raises(ValueError, match="torch|triton"):
        greedy_pick(torch.zeros(1, 3), "cuda")


HOPPER_COMPILE = r"""
from lorafleet.kernels.sampling import greedy_triton as gt

for dt in ("bf16", "fp16", "fp32"):
    for pdl in (False, True):
        split = {"logits_ptr": "*" + dt, "stride": "i32", "vocab": "i32", "span": "i32", "best_v_ptr": "*fp32",
                 "best_i_ptr": "*i32", "bad_ptr": "*i32"}
        # As the JIT specializes a vocabulary divisible by 16 (100,000; 32,000; 128,256; 151,936)
        k = compile_(gt._split_kernel, split, dict(SPLITS=16, BLOCK=2048, PDL=pdl), divisible=("stride", "span", "vocab"))
        assert "ld.global.v4" in k.asm["ptx"], "logits loads are not vectorised"
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
        finish = {"best_v_ptr": "*fp32", "best_i_ptr": "*i32", "bad_ptr": "*i32", "tokens_ptr": "*i64",
                  "shown_ptr": "*i64"}
        compile_(gt._finish_kernel, finish, dict(SPLITS=16, PDL=pdl), warps=1)
# One split a row (1,024 rows or more, or a vocabulary of at most 1,024): a 1-wide reduction.
compile_(gt._split_kernel, split, dict(SPLITS=1, BLOCK=1024, PDL=True), divisible=("stride", "span", "vocab"))
compile_(gt._finish_kernel, finish, dict(SPLITS=1, PDL=True), warps=1)
print("ok")
"""


def test_compiles_for_hopper():
    """Both kernels compile to sm_90 cubins with and without PDL (no GPU needed)."""
    run_hopper_compile(HOPPER_COMPILE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 8, 48, 64])
def test_bf16_at_the_seed_vocabulary(rows):
    x = _poisoned(rows, 100_000, torch.bfloat16, seed=rows).cuda()
    x[rows - 1] = torch.randn(100_000, device="cuda").to(torch.bfloat16) * 30  # wide range, many near-ties
    tokens, shown = greedy_pick(x, "triton")
    _oracle_check(x, tokens, shown)


@pytest.mark.gpu
@gpu
def test_captured_in_a_cuda_graph():
    """Captured once, replayed over new logits written into the same buffer (as a decode graph does)."""
    x = torch.randn(64, 100_000, device="cuda").to(torch.bfloat16)
    greedy_pick(x, "triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, shown = greedy_pick(x, "triton")
    for seed in range(3):  # (rows past the specials: random, so each replay's picks differ)
        x.copy_(_poisoned(64, 100_000, torch.bfloat16, seed=seed))
        graph.replay()
        _oracle_check(x, tokens, shown)

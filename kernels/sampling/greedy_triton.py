"""The Triton kernels of `greedy.greedy_pick` (that module's docstring has the semantics).

Program (row, split) reduces its range of the row to (max, first index, any non-finite); one
program a row then reduces the splits, in index order. About 1,024 programs in all, so a batch of
64 rows of 100,000 bf16 logits is read by the whole GPU at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels import pdl

# "No element": int32's largest, beyond any vocabulary index (greedy.check_logits keeps vocabularies
# below it). Globals a kernel reads must be constexpr.
NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _split_kernel(logits_ptr, stride, vocab, span, best_v_ptr, best_i_ptr, bad_ptr,
                  SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, split): the range [split·span, (split+1)·span) of the row, in BLOCK tiles."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * span
    end = tl.minimum(start + span, vocab)
    offs = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride
    # Per lane: the best value seen and its index (strictly greater wins: a lane keeps its first
    # index of a tie), reduced across lanes once after the loop.
    top_v = tl.full([BLOCK], float("-inf"), tl.float32)
    top_i = tl.full([BLOCK], NO_INDEX, tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for s in range(start, end, BLOCK):
        idx = s + offs
        mask = idx < end
        x = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
        nan = x != x
        bad |= ((nan | (tl.abs(x) == float("inf"))) & mask).to(tl.int32)
        take = (x > top_v) & ~nan
        top_i = tl.where(take, idx, top_i)
        top_v = tl.where(take, x, top_v)
    best = tl.max(top_v, 0)
    pick = tl.min(tl.where(top_v == best, top_i, NO_INDEX), 0)
    # A range all -inf (or NaN) never beat the initial -inf: its first element is its pick. An
    # empty range (start past the row) keeps NO_INDEX and never wins the final reduction.
    pick = tl.where((pick == NO_INDEX) & (start < vocab), start, pick)
    out = row * SPLITS + part
    tl.store(best_v_ptr + out, best)
    tl.store(best_i_ptr + out, pick)
    tl.store(bad_ptr + out, tl.max(bad, 0))


@triton.jit
def _finish_kernel(best_v_ptr, best_i_ptr, bad_ptr, tokens_ptr, shown_ptr, SPLITS: tl.constexpr,
                   PDL: tl.constexpr):
    """One program a row: the splits' picks (in index order) reduced to the row's."""
    pdl.start(PDL)  # first: nothing is read or written before the kernel ahead has completed
    row = tl.program_id(0)
    p = row * SPLITS + tl.arange(0, SPLITS)
    v = tl.load(best_v_ptr + p)
    i = tl.load(best_i_ptr + p)
    top = tl.min(tl.where(v == tl.max(v, 0), i, NO_INDEX), 0)
    token = top.to(tl.int64)
    tl.store(tokens_ptr + row, token)
    tl.store(shown_ptr + row, tl.where(tl.max(tl.load(bad_ptr + p), 0) > 0, -1, token))


def launch_shape(rows: int, vocab: int) -> tuple[int, int, int]:
    """(splits a row, span of a split, tile width): about 1,024 programs in all, spans a multiple
    of 16 values (so, with a row stride that is one too, each split starts 16-aligned and its loads
    are vectors), tiles of at most 2,048 values."""
    splits = triton.next_power_of_2(max(1, min(-(-1024 // max(rows, 1)), 64, -(-vocab // 1024))))
    span = -(-vocab // (16 * splits)) * 16
    return splits, span, min(2048, triton.next_power_of_2(span))


def greedy_pick_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy.greedy_pick on a checked `[N, vocab]` tensor, on its device."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    shown = torch.empty_like(tokens)
    if rows == 0:
        return tokens, shown
    splits, span, block = launch_shape(rows, vocab)
    best_v = torch.empty(rows * splits, dtype=torch.float32, device=logits.device)
    best_i = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    bad = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    use_pdl = pdl.row_kernel_pdl("greedy", logits)
    _split_kernel[(rows, splits)](logits, logits.stride(0), vocab, span, best_v, best_i, bad,
                                  SPLITS=splits, BLOCK=block, num_warps=4, **pdl.launch_kwargs(use_pdl))
    _finish_kernel[(rows,)](best_v, best_i, bad, tokens, shown, SPLITS=splits, num_warps=1,
                            **pdl.launch_kwargs(use_pdl))
    return tokens, shown



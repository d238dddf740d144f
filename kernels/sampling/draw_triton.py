"""A step's sampled tokens without sorting the rows: the Triton twin of worker/sampling/sampler.py's torch draw.

The torch path finds each row's threshold (min-p, then top-k, then top-p: one sort of every row)
and takes `argmax(scaled - log E)` over the tokens at or above it, `scaled = logits / temperature`
and `E ~ Exp(1)` the step's noise. This kernel returns the same token for the same noise without
the threshold, by rejection (the idea of FlashInfer's sort-free top-p sampling, here with the
noise fixed, so the answer is the torch path's token, not only its distribution):

- min-p and top-k bound the row from below: with `lo` = max(max + log min_p, the k-th largest
  scaled value), the tokens ≥ lo are the torch path's kept set before top-p (ties with the k-th
  kept). The k-th value comes in (`top_k_floor`: torch's `topk`, one call for the batch, faster
  than the searches over the value range we measured in the kernel; bench/sampling_cost.py);
- candidate = the argmax of the score over the tokens ≥ the top-k floor (the pass that also finds
  the max); a candidate with scaled value v is kept iff v ≥ lo and the mass above v is below
  top_p of the mass at or above lo: the torch path's threshold test, ties with the threshold kept;
- if it is not, neither is any token at or below v, so the next candidate is the argmax over the
  tokens above v and lo (found in the same pass as the test): the first candidate kept is the
  argmax over a superset of the kept set that lies in it, which is the argmax over the kept set
  (first index of a tie, as torch's argmax).

One program a row, each pass a read of the row: greedy, temperature-only and top-k rows take one,
min-p rows one more, top-p rows one more per rejected candidate (few: a candidate is rejected with
the probability of the mass outside the nucleus, and each rejection removes every token at or
below it).
Non-finite rows stop when no candidate is left; their token is dropped by the caller anyway.
`scaled` is computed with round-to-nearest division (torch's), so the two paths agree token for
token except where a mass sits on the top-p line within float rounding (exp and sums differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program reads per iteration
NUM_WARPS = 32


def draw_triton(logits: torch.Tensor, knobs: torch.Tensor, log_noise: torch.Tensor,
                top_k_floor: torch.Tensor | None, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """[N] int64 tokens. logits [N, vocab] float32 (edited, not scaled); knobs [5, N] float32 rows
    temperature, k-th position (unused here), top_p (> 1: none), greedy (1.0), log min_p (-inf:
    none); log_noise [N, vocab] float32 log E (greedy rows' is not read); top_k_floor [N] float32:
    each row's k-th largest scaled value (-inf: no top-k), None when no row asks for top-k. block,
    num_warps: the launch setting (vocabulary entries a program reads per iteration, its warps)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1 or log_noise.stride(1) != 1 or not knobs.is_contiguous():
        raise ValueError("logits and log_noise need unit stride along the vocabulary, knobs contiguous")
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    top_k = top_k_floor is not None
    _draw_kernel[(n,)](logits, log_noise, knobs, top_k_floor if top_k else knobs, tokens, n, vocab, logits.stride(0),
                       log_noise.stride(0), TOP_K=top_k, BLOCK=block, num_warps=num_warps)
    return tokens


@triton.jit
def _scaled(row_ptr, idx, mask, temperature):
    x = tl.load(row_ptr + idx, mask=mask, other=float("-inf"))
    return tl.math.div_rn(x, temperature)  # torch's division, not the approximate one


@triton.jit
def _no_best(BLOCK: tl.constexpr):
    """Per-lane (best score, its index) before any token: (-inf, 2**31-1)."""
    return tl.full([BLOCK], float("-inf"), tl.float32), tl.full([BLOCK], 2147483647, tl.int32)


@triton.jit
def _keep_best(best_v, best_i, take, score, idx):
    """Lanes where `take` (a better score, strictly: a lane keeps the first index of a tie) move on."""
    return tl.where(take, score, best_v), tl.where(take, idx, best_i)


@triton.jit
def _first_max(best_v, best_i):
    """(max, its first index) of per-lane bests; index 2**31-1 when no lane has one."""
    top = tl.max(best_v, 0)
    pick = tl.min(tl.where(best_v == top, best_i, 2147483647), 0)
    return top, pick


@triton.jit
def _pass_max(lrow, erow, vocab, temperature, sampled, floor, BLOCK: tl.constexpr):
    """One read: the row's max scaled value, and the argmax of its score (a greedy row's: of
    scaled) among the tokens with scaled ≥ floor."""
    offs = tl.arange(0, BLOCK)
    m_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_v, best_i = _no_best(BLOCK)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        mask = idx < vocab
        s = _scaled(lrow, idx, mask, temperature)
        m_v = tl.maximum(m_v, s)
        if sampled:
            score = s - tl.load(erow + idx, mask=mask, other=0.0)
        else:
            score = s
        best_v, best_i = _keep_best(best_v, best_i, (score > best_v) & mask & (s >= floor), score, idx)
    _, pick = _first_max(best_v, best_i)
    return tl.max(m_v, 0), pick


@triton.jit
def _pass_test(lrow, erow, vocab, temperature, m, lo, v, BLOCK: tl.constexpr):
    """One read: over the kept-so-far tokens (scaled ≥ lo), their mass Z and the mass A of those
    above v, and the argmax of the score among those above v (index 2**31-1: none)."""
    offs = tl.arange(0, BLOCK)
    z_v = tl.zeros([BLOCK], tl.float32)
    a_v = tl.zeros([BLOCK], tl.float32)
    best_v, best_i = _no_best(BLOCK)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        mask = idx < vocab
        s = _scaled(lrow, idx, mask, temperature)
        kept = (s >= lo) & mask
        above = kept & (s > v)
        e = tl.where(kept, tl.exp(s - m), 0.0)
        z_v += e
        a_v += tl.where(above, e, 0.0)
        score = s - tl.load(erow + idx, mask=mask, other=0.0)
        best_v, best_i = _keep_best(best_v, best_i, above & (score > best_v), score, idx)
    top, pick = _first_max(best_v, best_i)
    pick = tl.where(top > float("-inf"), pick, 2147483647)
    return tl.sum(z_v, 0), tl.sum(a_v, 0), pick


@triton.jit(do_not_specialize=["n"])  # one compile whatever the batch size (the engine's warm-up makes it)
def _draw_kernel(logits_ptr, noise_ptr, knobs_ptr, floor_ptr, tokens_ptr, n, vocab, stride_l, stride_e,
                 TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(knobs_ptr + row)
    top_p = tl.load(knobs_ptr + 2 * n + row)
    sampled = tl.load(knobs_ptr + 3 * n + row) == 0.0  # greedy rows: 1.0
    log_min_p = tl.load(knobs_ptr + 4 * n + row)
    lrow = logits_ptr + row.to(tl.int64) * stride_l
    erow = noise_ptr + row.to(tl.int64) * stride_e

    if TOP_K:
        floor = tl.load(floor_ptr + row)
    else:
        floor = float("-inf")
    m, cand = _pass_max(lrow, erow, vocab, temperature, sampled, floor, BLOCK)
    cand = tl.where(cand < vocab, cand, 0)  # no finite score (a non-finite row): any valid index
    if sampled:
        has_p = top_p <= 1.0
        lo = tl.maximum(m + log_min_p, floor)  # the min-p cut-off (-inf without), the top-k floor
        # Tokens ≥ lo are the min-p and top-k set: without top-p any of them is kept.
        v = tl.math.div_rn(tl.load(lrow + cand), temperature)
        settled = (v >= lo) & (not has_p)
        while not settled:
            z, mass_above, after = _pass_test(lrow, erow, vocab, temperature, m, lo, v, BLOCK)
            if ((v >= lo) & (mass_above < top_p * z)) | (after >= vocab):  # kept, or none above (not finite)
                settled = True
            else:
                cand = after
                v = tl.math.div_rn(tl.load(lrow + cand), temperature)
                settled = not has_p
    tl.store(tokens_ptr + row, cand.to(tl.int64))

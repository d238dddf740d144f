"""The Triton kernels of `lorafleet.kernels.sampling.logit_edits` (which says what they compute).

Which edits a step makes, which rows and how many are runtime arguments, not specialised on, so
each kernel compiles once (in the engine's warm-up, `LogitsProcessors.warm_up`), not at the
first request with a new mix of edits: a compile stalls every request of the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries a program
COUNT_BLOCK = 128  # edited requests a counting iteration


def edit_logits_triton(logits: torch.Tensor, plan: torch.Tensor, m: int, bias: torch.Tensor, counts: torch.Tensor,
                       in_prompt: torch.Tensor, *, every_row: bool, biased: bool, penalized: bool,
                       repetition: bool) -> torch.Tensor:
    out = torch.empty_like(logits) if every_row else logits.clone()
    vocab = logits.shape[1]
    _edit_kernel[(m, triton.cdiv(vocab, BLOCK))](
        logits, out, plan, bias, counts, in_prompt.view(torch.uint8), m, vocab, logits.stride(0), out.stride(0),
        int(every_row), int(biased), int(penalized), int(repetition), BLOCK=BLOCK, num_warps=4,
    )
    return out


def count_tokens_triton(counts: torch.Tensor, plan: torch.Tensor, m: int, tokens: torch.Tensor, *,
                        every_row: bool) -> None:
    _count_kernel[(1,)](counts, plan, tokens, m, counts.stride(0), int(every_row), BLOCK=COUNT_BLOCK, num_warps=1)


@triton.jit(do_not_specialize=["m", "every_row", "biased", "penalized", "repetition"])
def _edit_kernel(logits, out, plan, bias, counts, in_prompt, m, vocab, stride_l, stride_o,
                 every_row, biased, penalized, repetition, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    if every_row != 0:
        b = j.to(tl.int64)
    else:
        b = tl.load(plan + j).to(tl.int64)
    s = tl.load(plan + m + j).to(tl.int64)
    x = tl.load(logits + b * stride_l + cols, mask=inside, other=0.0)
    state = s * vocab + cols
    if biased != 0:
        x += tl.load(bias + state, mask=inside, other=0.0)
    if penalized != 0:
        c = tl.load(counts + state, mask=inside, other=0).to(tl.float32)
        if repetition != 0:
            rep = tl.load(plan + 2 * m + j)
            seen = (c > 0) | (tl.load(in_prompt + state, mask=inside, other=0) != 0)
            factor = tl.where(seen, rep, 1.0)
            x = tl.where(x > 0, x / factor, x * factor)
        frequency = tl.load(plan + 3 * m + j)
        presence = tl.load(plan + 4 * m + j)
        x = x - frequency * c - tl.where(c > 0, presence, 0.0)
    tl.store(out + b * stride_o + cols, x, mask=inside)


@triton.jit(do_not_specialize=["m", "every_row"])
def _count_kernel(counts, plan, tokens, m, stride_c, every_row, BLOCK: tl.constexpr):
    for start in range(0, m, BLOCK):
        j = start + tl.arange(0, BLOCK)
        on = j < m
        if every_row != 0:
            b = j.to(tl.int64)
        else:
            b = tl.load(plan + j, mask=on, other=0.0).to(tl.int64)
        s = tl.load(plan + m + j, mask=on, other=0.0).to(tl.int64)
        t = tl.load(tokens + b, mask=on, other=0)
        tl.atomic_add(counts + s * stride_c + t, 1, mask=on)

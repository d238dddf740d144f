"""The per-request logit edits of a step in one pass (worker/sampling/logits_processors.py holds the state and
the semantics): for each edited request j, batch row b = picked[j], state row s = rows[j],

    x = logits[b] (+ bias[s])
    repetition:  seen = counts[s] > 0 or in_prompt[s];  x = x / p if x > 0 else x * p  where seen
    penalties:   x = x - frequency * counts[s] - presence * (counts[s] > 0)
    out[b] = x                      (the other rows of out: logits' own)

and, once the step's tokens are drawn, counts[rows[j], tokens[b]] += 1 (`count_tokens`).

`plan` is the float32 vector the host uploads once a step: picked (m), rows (m), then repetition,
frequency and presence (m each) when any request is penalised; ids are exact in float32 below 2**24.
The torch reference (`edit_logits_reference`, the path without Triton and the tests' oracle) takes
~20 torch ops a step; on an H200 at batch 64 and a 100k vocabulary they cost ~0.5 ms a step
(bench/logit_edits.py), host dispatch and full-width temporaries. The Triton kernel reads each
edited row's logits and state once and writes it once (grid: edited rows × vocabulary blocks), and
the counting is one program (`logit_edits_triton`, imported only when used).
"""

from __future__ import annotations

import torch


def edit_logits(logits: torch.Tensor, plan: torch.Tensor, m: int, bias: torch.Tensor, counts: torch.Tensor,
                in_prompt: torch.Tensor, *, every_row: bool, biased: bool, penalized: bool, repetition: bool,
                backend: str = "torch") -> torch.Tensor:
    """The edited float32 copy of `logits` `[batch, vocab]` (module docstring); backend "triton"
    or "torch" (the reference)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be float32 [batch, vocab] with unit stride, got {logits.dtype} {tuple(logits.shape)}")
    if any(t.dim() != 2 or t.shape[1] != logits.shape[1] or not t.is_contiguous() for t in (bias, counts, in_prompt)):
        raise ValueError("bias, counts and in_prompt must be contiguous [rows, vocab] with the logits' vocabulary")
    if backend == "torch":
        return edit_logits_reference(logits, plan, m, bias, counts, in_prompt, every_row=every_row, biased=biased,
                                     penalized=penalized, repetition=repetition)
    if backend != "triton":
        raise ValueError(f"backend must be torch|triton, got {backend!r}")
    from lorafleet.kernels.sampling.logit_edits_triton import edit_logits_triton

    return edit_logits_triton(logits, plan, m, bias, counts, in_prompt, every_row=every_row, biased=biased,
                              penalized=penalized, repetition=repetition)


def edit_logits_reference(logits: torch.Tensor, plan: torch.Tensor, m: int, bias: torch.Tensor, counts: torch.Tensor,
                          in_prompt: torch.Tensor, *, every_row: bool, biased: bool, penalized: bool,
                          repetition: bool) -> torch.Tensor:
    picked, rows = plan[:m].long(), plan[m : 2 * m].long()
    sub = logits if every_row else logits.index_select(0, picked)
    sub = sub + bias.index_select(0, rows) if biased else sub.clone()
    if penalized:
        knobs = plan[2 * m : 5 * m].view(3, m, 1)
        c = counts.index_select(0, rows)
        if repetition:
            seen = (c > 0) | in_prompt.index_select(0, rows)
            factor = torch.where(seen, knobs[0], 1.0)
            sub = torch.where(sub > 0, sub / factor, sub * factor)
        sub = sub - knobs[1] * c - torch.where(c > 0, knobs[2], 0.0)  # as the kernel: one order of rounding
    return sub if every_row else logits.index_copy(0, picked, sub)


def count_tokens(counts: torch.Tensor, plan: torch.Tensor, m: int, tokens: torch.Tensor, *, every_row: bool,
                 backend: str = "torch") -> None:
    """counts[rows[j], tokens[picked[j]]] += 1 for each edited request j, in place (rows distinct)."""
    if backend == "triton":
        from lorafleet.kernels.sampling.logit_edits_triton import count_tokens_triton

        count_tokens_triton(counts, plan, m, tokens, every_row=every_row)
        return
    if backend != "torch":
        raise ValueError(f"backend must be torch|triton, got {backend!r}")
    picked, rows = plan[:m].long(), plan[m : 2 * m].long()
    mine = tokens if every_row else tokens.index_select(0, picked)
    counts.index_put_((rows, mine), torch.ones_like(mine, dtype=counts.dtype), accumulate=True)

"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafleet.worker.sequence import SamplingParams


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens with their logprobs


def sample(
    logits: torch.Tensor,  # [N, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row. Rows with temperature 0 (or top_k 1) take the argmax."""
    n = logits.shape[0]
    tokens = logits.argmax(dim=-1)  # [N]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        for i in random_rows:
            tokens[i] = _sample_row(logits[i], params[i], generators[i])
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    token_list = tokens.tolist()
    out: list[TokenLogprobs | None] = [None] * n
    if want_logprobs:
        logp = torch.log_softmax(logits[want_logprobs], dim=-1)  # the model's distribution, before sampling knobs
        for row, i in enumerate(want_logprobs):
            k = params[i].logprobs or 0
            top = torch.topk(logp[row], k) if k else None
            out[i] = TokenLogprobs(
                token_id=token_list[i],
                logprob=float(logp[row, token_list[i]]),
                top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            )
    return token_list, out


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))

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
    """One token per row. Rows with temperature 0 (or top_k 1) take the argmax.

    A row whose logits are not finite (an overflow in half precision) gets token -1: the engine
    ends that request with an error instead of failing the whole batch. The step syncs with the
    host once, when the tokens are read.
    """
    n = logits.shape[0]
    finite = torch.isfinite(logits).all(dim=-1)  # [N]
    safe = torch.where(finite.unsqueeze(1), logits, torch.zeros_like(logits))
    tokens = safe.argmax(dim=-1)  # [N]
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(safe[i], p, generators[i])
    tokens = torch.where(finite, tokens, torch.full_like(tokens, -1))
    token_list = tokens.tolist()
    out: list[TokenLogprobs | None] = [None] * n
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None and token_list[i] >= 0]
    if want_logprobs:
        logp = torch.log_softmax(safe[want_logprobs], dim=-1)  # the model's distribution, before sampling knobs
        chosen = logp[torch.arange(len(want_logprobs)), [token_list[i] for i in want_logprobs]].tolist()
        k_max = max(params[i].logprobs or 0 for i in want_logprobs)
        top_values, top_ids = (torch.topk(logp, k_max) if k_max else (None, None))
        top_values = top_values.tolist() if k_max else None
        top_ids = top_ids.tolist() if k_max else None
        for row, i in enumerate(want_logprobs):
            k = params[i].logprobs or 0
            top = list(zip(top_ids[row][:k], top_values[row][:k])) if k else []
            out[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen[row], top=top)
    return token_list, out


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one token on the device (no host sync): a 0-d tensor."""
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
    return torch.multinomial(probs, 1, generator=generator)[0]

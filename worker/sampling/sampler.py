"""Turn a step's logits into tokens: greedy, temperature, min-p, top-k, top-p, per-request seeds,
logprobs; the requests' own logit edits (penalties, logit_bias, ...: worker/sampling/logits_processors.py)
applied first.

Every row goes through one batched pass on the logits' device, whatever the mix of knobs: the
per-row knobs travel in one small host-to-device copy, top-k / top-p become one threshold per row
(one sort of the batch's rows, or one `topk` when no row asks for top-p; min-p before them, as in
vLLM), and the token is drawn
with the exponential race: `argmax(probs / E) == argmax(log probs - log E)` with `E ~ Exp(1)`
i.i.d. per vocabulary entry is an exact sample from `probs` (greedy rows take `E = 1`: the argmax).
That is `draw_reference`; on CUDA `kernels/sampling/draw_triton.py` returns the same token from the same
noise without the sort (`LORAFLEET_SAMPLER=torch` keeps the reference there too).
A seeded row draws its `E` from its own generator (one kernel for that row), so its tokens depend
only on its seed and its logits, never on the rest of the batch; the other sampled rows draw theirs
from one shared generator in one call. The host syncs once per step: tokens and logprobs are
gathered on the device and copied back together. `sample_on_device` stops before that read and
returns the device tensors (`SampledTokens`), so async scheduling (worker/engine/async_step.py) can feed
the tokens to the next step first; `sample` is `sample_on_device(...).read()`. A decode graph
hands in its own greedy picks (kernels/sampling/greedy.py) with logits left in the model's dtype: an
all-greedy batch without logprobs or logit edits takes the picks, any other converts the logits to
float32 first. Logprobs are the model's distribution, before edits and knobs (vLLM's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch
import torch.nn.functional as F

from lorafleet.worker import envs
from lorafleet.worker.engine.sequence import SamplingParams


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float | None  # None: a prompt token whose logits were not finite (prompt logprobs only)
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens with their logprobs
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs; vLLM's rank)


# (tokens, shown) for every row, made on the device: kernels/sampling/greedy.py's `greedy_pick`.
GreedyPick = tuple[torch.Tensor, torch.Tensor]


class LogitsEdit(Protocol):
    """A step's per-request logit edits (logits_processors.LogitsEdit)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...  # an edited float32 copy

    def record(self, tokens: torch.Tensor) -> None: ...  # the step's sampled tokens, on the device

# The draw on CUDA: "triton" (kernels/sampling/draw_triton.py, no sort) or "torch" (draw_reference).
CUDA_DRAW = envs.SAMPLER

# Unseeded rows draw their noise from one generator per device, seeded from the OS on first use.
_shared_generators: dict[torch.device, torch.Generator] = {}


def shared_generator(device: torch.device) -> torch.Generator:
    gen = _shared_generators.get(device)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.seed()
        _shared_generators[device] = gen
    return gen


def warm_up(vocab: int, device: torch.device) -> None:
    """Draw once with and once without a top-k floor, so the CUDA draw's two kernels
    (kernels/sampling/draw_triton.py) compile now, not at the first request that samples."""
    for knobs in (dict(top_p=0.9), dict(top_k=2, top_p=0.9)):
        sample(torch.zeros(1, vocab, device=device), [SamplingParams(max_tokens=1, **knobs)], [None])


def sample(
    logits: torch.Tensor,  # [N, vocab], float32 (other float dtypes are converted)
    params: list[SamplingParams],
    generators: list[torch.Generator | None],  # a row's own generator (seeded requests), else None
    greedy: GreedyPick | None = None,
    edit: LogitsEdit | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row. Greedy rows (temperature below 1e-5, or top_k 1) take the argmax.

    A sampled row with a generator draws from it; one without draws from the device's shared
    generator. A row whose logits are not finite (an overflow in half precision) gets token -1:
    the engine ends that request with an error instead of failing the whole batch. The step syncs
    with the host once, when tokens (and logprobs) are read. `greedy`: the rows' greedy picks
    already made on the device (a decode graph's, kernels/sampling/greedy.py), taken as they are when
    every row is greedy and none asks for logprobs. `edit`: the rows' logit edits, applied to a
    copy before the knobs; a row whose model logits are not finite still gets -1.
    """
    if logits.shape[0] == 0:
        return [], []
    return sample_on_device(logits, params, generators, greedy, edit).read()


@dataclass(slots=True)
class SampledTokens:
    """One step's sampled tokens, still on the device: `read()` is the step's one host sync.

    `token_ids` can feed the next step before the host has seen them (async scheduling): it holds
    every row's sampled id, a valid vocabulary index even for a row with non-finite logits (those
    rows read as -1). `start_copy()` queues the device-to-host copy into pinned memory behind the
    sampling kernels (CUDA), so `read()` then waits for that copy only, not for later work.
    """

    token_ids: torch.Tensor  # [N] int64 on the logits' device
    packed: torch.Tensor  # what the host reads: tokens (-1: not finite), then any logprobs data
    params: list[SamplingParams]
    lp_rows: list[int]  # rows that asked for logprobs
    k_max: int  # top logprobs gathered per such row
    _host: torch.Tensor | None = None  # pinned copy of `packed` (CUDA, after start_copy)
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> SampledTokens:
        if self.packed.device.type == "cuda" and self._host is None:
            host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            host.copy_(self.packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.packed.device))
            self._host = host
        return self

    def read(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Host lists: one token per row (-1: logits not finite) and each row's logprobs (or None)."""
        if self._host is not None:
            assert self._ready is not None
            self._ready.synchronize()
            values = self._host.tolist()
        else:
            values = self.packed.tolist()  # float64 holds token ids and float32 logprobs exactly
        return _unpack(values, self.params, self.lp_rows, self.k_max)


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: GreedyPick | None = None,
    edit: LogitsEdit | None = None,
    draw: str | None = None,
) -> SampledTokens:
    """`sample`'s kernels, queued; nothing is read on the host (see SampledTokens). draw: the draw on
    CUDA, "triton" or "torch" (default: CUDA_DRAW, from LORAFLEET_SAMPLER)."""
    if greedy is not None and edit is None and all(p.greedy and p.logprobs is None for p in params):
        tokens, shown = greedy
        return SampledTokens(tokens, shown, params, [], 0)
    logits = logits.float()  # no copy when it is float32 already
    n, vocab = logits.shape
    dev = logits.device
    # inf / nan anywhere in a row makes its sum inf / nan: one reduction instead of a mask pass.
    # (Finite logits overflow a float32 sum only past ~1e33 each, far beyond any model's.)
    # Non-finite rows are sampled like the others and their results dropped: no copy to sanitise.
    finite = torch.isfinite(logits.sum(dim=-1))
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    subset = 0 < len(lp_rows) < n
    knobs = _Knobs(params, vocab)
    uploaded = _upload(knobs.values + (lp_rows if subset else []), dev) if knobs.any_sampled or subset else None

    edited = logits if edit is None else edit.apply(logits)
    if edit is not None:  # a row the edits left without any token (all -inf) ends its request with an error
        finite &= edited.amax(dim=-1) > float("-inf")
    if knobs.any_sampled:
        tokens = _sample_rows(edited, uploaded[: _Knobs.ROWS * n].view(_Knobs.ROWS, n), knobs, generators, draw)
    else:
        tokens = edited.argmax(dim=-1)
    if edit is not None:
        edit.record(tokens)
    shown = torch.where(finite, tokens, -1)
    if not lp_rows:
        return SampledTokens(tokens, shown, params, lp_rows, 0)

    # Logprobs are the model's distribution, before the sampling knobs.
    if subset:
        idx = uploaded[len(knobs.values) :].long()
        rows_logits, rows_tokens = logits.index_select(0, idx), tokens.index_select(0, idx)
    else:
        rows_logits, rows_tokens = logits, tokens
    logp = torch.log_softmax(rows_logits, dim=-1)
    parts = [shown.double(), logp.gather(1, rows_tokens.unsqueeze(1)).view(-1)]
    k_max = min(max(params[i].logprobs or 0 for i in lp_rows), vocab)
    if k_max:
        top = torch.topk(logp, k_max, dim=-1)
        parts += [top.values.reshape(-1), top.indices.reshape(-1)]
    return SampledTokens(tokens, torch.cat(parts), params, lp_rows, k_max)


def _unpack(
    host: list, params: list[SamplingParams], lp_rows: list[int], k_max: int
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """SampledTokens.packed, read on the host, back into tokens and per-row logprobs."""
    n = len(params)
    if not lp_rows:
        return host, [None] * n
    m = len(lp_rows)
    token_list = [int(t) for t in host[:n]]
    chosen = host[n : n + m]
    top_values = host[n + m : n + m + m * k_max]
    top_ids = host[n + m + m * k_max :]
    out: list[TokenLogprobs | None] = [None] * n
    for row, i in enumerate(lp_rows):
        if token_list[i] < 0:
            continue
        k = min(params[i].logprobs or 0, k_max)
        base = row * k_max
        top_list = [(int(top_ids[base + j]), top_values[base + j]) for j in range(k)]
        out[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen[row], top=top_list)
    return token_list, out


class _Knobs:
    """The rows' knobs as five float rows (temperature, k-th position, top_p, greedy, log min_p),
    built on the host.

    Greedy rows get neutral knobs (their noise is 1: the argmax). A row without top-k points at the
    last sorted position and a row without top-p gets a mass it never reaches, so both thresholds
    fall on the row's minimum and mask nothing; a row without min-p has log 0 = -inf, no cut-off.
    """

    ROWS = 5

    def __init__(self, params: list[SamplingParams], vocab: int) -> None:
        temperature, k_index, top_p, greedy, log_min_p = [], [], [], [], []
        self.k_max, self.any_p, self.any_min_p, self.n_greedy = 0, False, False, 0
        for p in params:
            on = not p.greedy
            k = p.top_k if on and 0 < p.top_k < vocab else 0
            self.k_max = max(self.k_max, k)
            self.any_p = self.any_p or (on and p.top_p < 1.0)
            self.any_min_p = self.any_min_p or (on and p.min_p > 0.0)
            self.n_greedy += not on
            temperature.append(p.temperature if on else 1.0)
            k_index.append(k - 1 if k else vocab - 1)
            top_p.append(p.top_p if on and p.top_p < 1.0 else 2.0)
            greedy.append(0.0 if on else 1.0)
            log_min_p.append(math.log(p.min_p) if on and p.min_p > 0.0 else float("-inf"))
        self.params = params
        self.any_sampled = self.n_greedy < len(params)
        self.values = temperature + k_index + top_p + greedy + log_min_p if self.any_sampled else []


def _upload(values: list[float], device: torch.device) -> torch.Tensor:
    """float32 values on `device` in one asynchronous copy (exact for integers below 2**24).

    From pageable memory, as ModelRunner.prepare does: on an H200 the host did not wait for queued
    GPU work, and a pinned buffer (fresh or reused) was no faster for a few hundred floats.
    """
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def _sample_rows(
    logits: torch.Tensor, knobs_t: torch.Tensor, knobs: _Knobs, generators: list[torch.Generator | None],
    draw: str | None = None,
) -> torch.Tensor:
    """A token for every row in one batched pass (greedy rows: the argmax); on the device."""
    log_noise = _log_noise(logits, knobs, generators)
    if logits.device.type == "cuda" and (CUDA_DRAW if draw is None else draw) == "triton":
        from lorafleet.kernels.sampling.draw_triton import draw_triton

        return draw_triton(logits, knobs_t, log_noise, top_k_floor(logits, knobs_t, knobs.k_max))
    return draw_reference(logits, knobs_t, log_noise, knobs.k_max, knobs.any_p, knobs.any_min_p)


def top_k_floor(logits: torch.Tensor, knobs_t: torch.Tensor, k_max: int) -> torch.Tensor | None:
    """[N]: each row's k-th largest scaled value (-inf: no top-k), None when no row has top-k.

    From the logits, not scaled: dividing by a positive temperature keeps the order, and rounding
    is monotone, so (k-th largest logit) / temperature is the k-th largest of logits / temperature.
    """
    if not k_max:
        return None
    kth = _threshold(logits, knobs_t[1].long().unsqueeze(1), knobs_t[2].unsqueeze(1), k_max, any_p=False)
    return kth.view(-1) / knobs_t[0]


def _log_noise(logits: torch.Tensor, knobs: _Knobs, generators: list[torch.Generator | None]) -> torch.Tensor:
    """log E for every row, E ~ Exp(1): unseeded rows from the device's shared generator in one
    call, each seeded row from its own generator (greedy rows' values are not used)."""
    params = knobs.params
    noise = torch.empty_like(logits)
    seeded = [(i, g) for i, (p, g) in enumerate(zip(params, generators)) if g is not None and not p.greedy]
    if len(seeded) + knobs.n_greedy < len(params):
        noise.exponential_(generator=shared_generator(noise.device))  # every row at once
    for i, gen in seeded:
        noise[i].exponential_(generator=gen)  # seeded rows redrawn from their own generator
    # E == 0 (possible on CPU) would make a masked token's score -inf + inf = nan: clamp first.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_()


def draw_reference(
    logits: torch.Tensor,  # [N, vocab] float32, edited, not scaled
    knobs_t: torch.Tensor,  # [5, N] (_Knobs)
    log_noise: torch.Tensor,  # [N, vocab] log E; overwritten
    k_max: int,
    any_p: bool,
    any_min_p: bool,
) -> torch.Tensor:
    """The torch draw (kernels/sampling/draw_triton.py is its twin on CUDA): each row's threshold, then
    argmax(scaled - log E) over the tokens at or above it; greedy rows the argmax of scaled."""
    scaled = logits / knobs_t[0].unsqueeze(1)
    if any_min_p:  # p >= min_p * p_max, in logits: scaled >= max + log min_p (vLLM: before top-k/p)
        cutoff = scaled.amax(dim=-1, keepdim=True) + knobs_t[4].unsqueeze(1)
        scaled.masked_fill_(scaled < cutoff, float("-inf"))
    if k_max or any_p:
        k_index = knobs_t[1].long().unsqueeze(1)
        threshold = _threshold(scaled, k_index, knobs_t[2].unsqueeze(1), k_max, any_p)
        scaled.masked_fill_(scaled < threshold, float("-inf"))
    log_noise.masked_fill_(knobs_t[3].unsqueeze(1) > 0, 0.0)  # E = 1: greedy rows keep their argmax
    return scaled.sub_(log_noise).argmax(dim=-1)


def _threshold(
    scaled: torch.Tensor,  # [N, vocab] logits / temperature
    k_index: torch.Tensor,  # [N, 1] int64: position of the k-th best token (vocab - 1: no top-k)
    top_p: torch.Tensor,  # [N, 1]: nucleus mass (> 1: no top-p)
    k_max: int,
    any_p: bool,
) -> torch.Tensor:
    """[N, 1]: the smallest scaled logit each row keeps after top-k, then top-p.

    Tokens tied with the threshold are all kept. A row's threshold is the same whichever path the
    batch takes (sort or topk), so seeded rows do not depend on their neighbours' knobs.
    """
    if not any_p:
        best = scaled.topk(k_max, dim=-1).values  # [N, k_max], descending
        kth = best.gather(1, k_index.clamp(max=k_max - 1))
        return kth.masked_fill_(k_index >= k_max, float("-inf"))
    vocab = scaled.shape[-1]
    desc = scaled.sort(dim=-1, descending=True).values
    kth = desc.gather(1, k_index)
    probs = torch.softmax(desc.masked_fill(desc < kth, float("-inf")) if k_max else desc, dim=-1)
    # The smallest prefix whose mass reaches top_p: the c tokens whose running mass stays below
    # top_p, plus the one that crosses it (position c). The running mass only grows, so a count is
    # a position; a row without top-p never crosses and lands on its last (smallest) token.
    below = _count_cumsum_below(probs, top_p)
    return torch.maximum(kth, desc.gather(1, below.clamp_(max=vocab - 1)))


@lru_cache(maxsize=16)
def _chunk(vocab: int) -> int:
    """A chunk width near 1024 that divides `vocab` (no padding), else 1024."""
    divisors = [b for b in range(512, 4097) if vocab % b == 0]
    return min(divisors, key=lambda b: abs(b - 1024)) if divisors else 1024


def _count_cumsum_below(probs: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[N, 1] int64: how many entries of each row's running sum are < bound ([N, 1]).

    torch's scan along a few long rows keeps few blocks busy (212 us for 64 x 128k on an H200), so
    rows are scanned in chunks, and each chunk compares against the bound minus the chunk's carry.
    """
    n, vocab = probs.shape
    b = _chunk(vocab)
    if vocab <= 2 * b:
        return (probs.cumsum(dim=-1) < bound).sum(dim=-1, keepdim=True)
    if vocab % b:
        probs = F.pad(probs, (0, b - vocab % b))  # zeros: the running sum stays flat there
    chunks = probs.view(n, -1, b).cumsum(dim=-1)  # [N, C, b]: running sum within each chunk
    totals = chunks[:, :, -1]
    carry = totals.cumsum(dim=-1) - totals  # [N, C]: mass of the chunks before
    return (chunks < (bound - carry).unsqueeze(-1)).sum(dim=(1, 2)).unsqueeze(1)

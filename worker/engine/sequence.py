"""A request as the scheduler sees it: token ids, adapters, KV blocks and progress (torch-free)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.sampling.structured import Constraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# torch's generators take a seed in this range (negative ones wrap to 2**64 + seed); outside it
# `manual_seed` raised inside the engine step, failing every request of the batch.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Below this temperature a request is greedy, as in vLLM: in float32 a smaller one is 0 or
# subnormal, and logits / temperature overflows.
MIN_TEMPERATURE = 1e-5
# vLLM has no cap; 8 requests of 200,000 ids each slowed a whole worker (a scan per token).
MAX_STOP_TOKEN_IDS = 64
# logit_bias entries a request may set (OpenAI's values: -100..100). Built once per request into a
# row of device state (worker/sampling/logits_processors.py), so the cap only bounds that one-time upload.
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# allowed_token_ids: checked on the engine thread at admission, so bounded (the largest vocabularies' size).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# bad_words: each one's token sequences are matched against the output's tail at every step.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256  # they are tokenized on the engine thread, at admission


class SamplingError(ValueError):
    """A sampling knob out of range; `param` names the request field (the HTTP 400's param)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """OpenAI-style sampling knobs; validated at construction so a bad request fails before queueing."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs to return per generated token (0 = only the chosen one)
    # vLLM's prompt_logprobs: each prompt token's logprob given the tokens before it, with the top k
    # (0: the token's alone); the request's prompt is then computed in full (no prefix-cache hits).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text (not of token ids or logprobs)
    # Logit edits (worker/sampling/logits_processors.py, vLLM's semantics): OpenAI's penalties on the output's
    # tokens, vLLM's repetition penalty on the prompt's and the output's, min_p after temperature,
    # no stop token (EOS, stop_token_ids) and no stop string before min_tokens, a bias per token id,
    # and only allowed_token_ids (None: any).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()  # vLLM's: never generated (the engine tokenizes them: Sequence.bad_word_ids)
    constraint: Constraint | None = None  # structured outputs (worker/sampling/structured.py): the answer's grammar
    # The constraint holds from the token after this one (a reasoning model's `</think>`,
    # worker/openai/reasoning.py), not from the first; None: from the first.
    constraint_after: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature", "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be in 0..20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "prompt_logprobs must be in 0..20"),
            (len(self.stop) <= 16 and all(self.stop), "stop", "stop: at most 16 non-empty strings"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids ({len(self.stop_token_ids)} given)"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
             f"seed must be in {SEED_MIN}..{SEED_MAX}, the range torch's generators take"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty", "repetition_penalty must be above 0"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
             f"logit_bias: at most {MAX_LOGIT_BIAS} entries ({len(self.logit_bias)} given)"),
            (all(LOGIT_BIAS_RANGE[0] <= b <= LOGIT_BIAS_RANGE[1] for _, b in self.logit_bias), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
            (len(self.bad_words) <= MAX_BAD_WORDS and all(0 < len(w.strip()) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
             "bad_words", f"bad_words: at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_CHARS} characters"),
            (self.allowed_token_ids is None or 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
             "allowed_token_ids", f"allowed_token_ids: 1 to {MAX_ALLOWED_TOKEN_IDS} token ids"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty counts this request's tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def edits_logits(self) -> bool:
        """Whether the logits are edited before sampling (all but min_p, a sampling knob)."""
        return (self.penalized or bool(self.logit_bias) or self.allowed_token_ids is not None or self.min_tokens > 0
                or bool(self.bad_words))

    def named_token_ids(self) -> dict[str, tuple[int, ...]]:
        """The token ids the request names, by field: the engine checks them against the vocabulary."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": tuple(t for t, _ in self.logit_bias),
                "allowed_token_ids": self.allowed_token_ids or ()}


@dataclass(slots=True)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    adapters: tuple[tuple[str, float], ...] = ()  # (adapter name, scale); empty = base model only
    cache_salt: str = ""  # the adapter set with scales and digests: prefix blocks are shared only under it
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids, and EOS unless ignore_eos: checked per token
    # sampling.bad_words as token sequences (vLLM's rule: each word as written and after a space)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    grammar: Any = None  # sampling.constraint's xgrammar matcher, advanced by each sampled token
    grammar_waits: bool = False  # the grammar holds only once sampling.constraint_after has been sampled
    # With sampling.prompt_logprobs: entry i is prompt token i + 1's (sampling.TokenLogprobs), filled
    # as the prompt's chunks are computed (a recomputed prefix is not counted twice).
    prompt_lps: list = field(default_factory=list)
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    deferred_steps: int = 0  # consecutive steps this waiting request could not get an adapter slot
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed

    @property
    def needs_host_tokens(self) -> bool:
        """A bad word of several tokens is matched against the output's tail on the host, and a
        grammar's mask follows the last token: the step after a token is sampled only once the host
        has read it (async scheduling then samples it after the replay, worker/engine/async_step.py)."""
        return self.grammar is not None or any(len(w) > 1 for w in self.bad_word_ids)

    def advance_grammar(self, token: int) -> bool:
        """The grammar takes a sampled token: whether that ends the request (the grammar's end, or
        a token it refuses, which its mask should never let through). Before
        sampling.constraint_after is sampled it only waits for it."""
        if self.grammar is None:
            return False
        if self.grammar_waits:
            self.grammar_waits = token != self.sampling.constraint_after
            return False
        return not self.grammar.accept_token(token) or self.grammar.is_terminated()

    @property
    def scores_prompt(self) -> bool:
        """Prompt tokens still to score (sampling.prompt_logprobs): then no prefix-cache hit may skip
        them, and the scheduler bounds the step's scored tokens."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_lps) < len(self.prompt_ids) - 1

    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.adapters)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

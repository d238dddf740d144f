"""What the engine hands back for a request: a step's streaming delta or its final state
(`RequestOutput`), an offline `generate` result (`Completion`); and how a request's text becomes
those deltas (`TrackedRequest`): detokenized incrementally, cut at a stop string (`find_stop`),
characters that may still become one held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.worker.engine.sequence import Sequence
from lorafleet.worker.engine.tokenizer import IncrementalDetokenizer
from lorafleet.worker.sampling.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a streaming delta), or its final state."""

    request_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # sampling.prompt_logprobs: prompt token i + 1's logprob at entry i; on the first output only
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class Completion:
    """An offline `generate` result."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # as RequestOutput's


@dataclass(slots=True)
class TrackedRequest:
    """A request the engine tracks: its sequence, its detokenizer, the text returned so far."""

    seq: Sequence
    detok: IncrementalDetokenizer
    emitted: int = 0  # characters of text already returned
    # Text before this many characters ends no request: what came out before min_tokens tokens.
    stop_from: int = 0

    def text_delta(self, reason: str | None, stop_token: bool) -> tuple[str, str | None]:
        """The text to return for the token just appended to `seq.output_ids`, and the finish
        reason: `reason` (None: not finishing; `stop_token`: the token is one), or "stop" where a
        stop string ends the text."""
        seq, sp = self.seq, self.seq.sampling
        if reason is None:
            self.detok.update(seq.output_ids)
            text = self.detok.text
        else:  # the final text: a trailing partial character left out (vLLM's rule), so is a stop token's text
            text = self.detok.finish(seq.output_ids[:-1] if stop_token else seq.output_ids)
        # Stop strings count once min_tokens tokens are out (vLLM's rule), and only where they start
        # after the text of those tokens, which is returned as it comes.
        checking = bool(sp.stop) and len(seq.output_ids) > sp.min_tokens
        if checking:
            hit = find_stop(text, sp.stop, self.emitted, sp.include_stop_str_in_output, self.stop_from)
            if hit is not None:
                text, reason = text[:hit], "stop"
        elif sp.stop:
            self.stop_from = len(text)
        # While a stop string could still be forming at the end, hold those characters back.
        safe = len(text) if reason or not checking else max(self.emitted, len(text) - max(map(len, sp.stop)) + 1)
        delta = text[self.emitted:safe]
        self.emitted = safe
        return delta, reason


def find_stop(text: str, stops: tuple[str, ...], start: int, include: bool, floor: int = 0) -> int | None:
    """Where `text` is cut by its stop strings: the least start (end, if `include`) of any found,
    None if none is. The search begins a stop's length before `start`, so one straddling it is found,
    and never before `floor`."""
    best = None
    for stop in stops:
        i = text.find(stop, max(floor, start - len(stop) + 1))
        if i >= 0:
            end = i + len(stop) if include else i
            best = end if best is None else min(best, end)
    return best

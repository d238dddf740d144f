"""Offline generation: prompts run to completion in shared batches (`LLMEngine.generate`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol

from lorafleet.worker.engine.outputs import Completion, RequestOutput
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.sampling.sampler import TokenLogprobs


class SteppedEngine(Protocol):
    """What offline generation uses of `LLMEngine` (engine.py), which calls it."""

    scheduler: Any
    _tracked: dict[int, Any]

    def add_request(self, prompt: str | list[int], sampling: SamplingParams,
                    adapters: Seq[tuple[str, float]]) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    def drain(self) -> list[RequestOutput]: ...


def run_to_completion(engine: SteppedEngine, prompts: Seq[str | list[int]], params: Seq[SamplingParams],
                      adapter_sets: Seq[Seq[tuple[str, float]]]) -> list[Completion]:
    """Add every prompt (with its sampling and adapters, one each), step the engine until each has
    finished; results in prompt order."""
    n = len(prompts)
    ids = [engine.add_request(p, s, a) for p, s, a in zip(prompts, params, adapter_sets)]
    results: dict[int, Completion] = {}
    prompt_ids = {rid: engine._tracked[rid].seq.prompt_ids for rid in ids}
    texts: dict[int, list[str]] = {rid: [] for rid in ids}
    tokens: dict[int, list[int]] = {rid: [] for rid in ids}
    lps: dict[int, list[TokenLogprobs]] = {rid: [] for rid in ids}
    prompt_lps: dict[int, list[TokenLogprobs] | None] = {}
    while len(results) < n:
        for out in engine.step():
            rid = out.request_id
            texts[rid].append(out.text_delta)
            tokens[rid].extend(out.new_token_ids)
            lps[rid].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_lps[rid] = out.prompt_logprobs
            if out.finished:
                results[rid] = Completion(prompt_ids[rid], tokens[rid], "".join(texts[rid]), out.finish_reason or "stop",
                                          lps[rid], prompt_lps.get(rid))
    if not engine.scheduler.has_work:
        engine.drain()  # a step in flight holding only finished requests: free their blocks now
    return [results[rid] for rid in ids]

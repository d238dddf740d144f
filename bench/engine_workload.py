"""The timed workloads of the engine benchmarks: a decode batch, time to first token, fresh prompts.

decode_run() submits a batch at once and times its all-decode steps as one phase (tokens/s, step
time, the batch's TTFT); ttft() times fresh prompts to their first token; start_decode() queues a
batch and runs its prefill, for callers that time the decode steps themselves. Every prompt comes
from fresh_prompt(), which shares no block with any earlier prompt of the process, so no run is
helped by the prefix cache.
"""

from __future__ import annotations

import itertools
import time

import torch

from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_PROMPTS = itertools.count()  # every prompt of a run differs from all others: no prefix-cache hits


def fresh_prompt(engine: LLMEngine, prompt_len: int) -> list[int]:
    """A prompt no earlier one of this process shares a block with: its first three tokens spell a
    running count in base `vocab`."""
    vocab = engine.model_config.vocab_size - 10
    n = next(_PROMPTS)
    digits = [(n // vocab**i) % vocab for i in range(3)]  # n in base `vocab`: unique below vocab**3
    return [10 + (digits[j] if j < 3 else n * 7919 + j * 31) % vocab for j in range(prompt_len)]


def decode_run(engine: LLMEngine, adapter_sets, prompt_len: int, new_tokens: int, knobs: dict | None = None,
               leading: tuple[int, dict] = (0, {})) -> dict:
    """`knobs`: SamplingParams fields for every request (default greedy); `leading` = (n, fields):
    the first n requests take these fields on top."""
    knobs = knobs or {"temperature": 0.0}
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **knobs)
    special = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **{**knobs, **leading[1]}) if leading[0] else sp
    hits0 = engine.blocks.prefix_hits
    sync()
    submitted = time.perf_counter()
    for i, adapters in enumerate(adapter_sets):
        engine.add_request(fresh_prompt(engine, prompt_len), special if i < leading[0] else sp, adapters)
    first: dict[int, float] = {}  # request -> seconds from submission to its first token on the host
    # Timed as one phase, from the first all-decode step to idle, without a sync per step: with
    # async scheduling a step's outputs come from the step launched before it, and a sync after
    # each step() would stall the pipeline. (num_uncomputed is 0 for a token still in flight.)
    decode_tokens, t0 = 0, None
    while engine.has_unfinished():
        if t0 is None and engine.scheduler.running and not engine.scheduler.waiting and all(
                s.num_uncomputed <= 1 for s in engine.scheduler.running):
            sync()
            t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            first.setdefault(out.request_id, now - submitted)
        if t0 is not None:
            decode_tokens += len(outs)
    sync()
    decode_time = time.perf_counter() - t0
    firsts = sorted(first.values())
    return {"tokens_per_s": round(decode_tokens / decode_time, 1),
            "decode_step_ms": round(1e3 * decode_time / max(1, decode_tokens / len(adapter_sets)), 2),
            # the whole batch submitted at once: its prefill steps, then the first sampled tokens
            "batch_ttft_ms_median": round(1e3 * firsts[len(firsts) // 2], 2), "batch_ttft_ms_max": round(1e3 * firsts[-1], 2),
            "prefix_hit_tokens": engine.blocks.prefix_hits - hits0}


def ttft(engine: LLMEngine, prompt_len: int, count: int = 1) -> float:
    """ms from submitting `count` new prompts at once (nothing of them cached) to the last one's
    first token on the host."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    hits0 = engine.blocks.prefix_hits
    for _ in range(count):
        engine.add_request(fresh_prompt(engine, prompt_len), sp)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    elapsed = (time.perf_counter() - t0) * 1e3
    if engine.blocks.prefix_hits != hits0:  # (the earlier benchmark re-sent one prompt: a cached prefill)
        raise RuntimeError("a TTFT prompt hit the prefix cache")
    return elapsed


def start_decode(engine: LLMEngine, adapter_sets, prompt_len: int, new_tokens: int) -> None:
    """Queue the batch and run its prefill steps, so every later step is an all-decode step."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for adapters in adapter_sets:
        engine.add_request(fresh_prompt(engine, prompt_len), sp, adapters)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()


def adapter_sets(names: list[str], d: int, batch: int):
    return [()] * batch if d == 0 else [((names[r % d], 1.0),) for r in range(batch)]

"""Prompt logprobs (vLLM's `prompt_logprobs`, and what completions' echo with logprobs returns): each
prompt token's logprob given the tokens before it, against transformers (fp32, CPU), whether the
prompt is computed in one chunk or several, twice in a row (no prefix-cache hit may skip a
position), or recomputed after a preemption (no position scored twice)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

pytest.importorskip("transformers")

from .peft_oracle import load_hf_base  # noqa: E402

PROMPT = "Once upon a time there was a model with many adapters, and every tenant was happy with it."


@pytest.fixture(scope="module")
def hf(demo_model):
    return load_hf_base(demo_model)


def oracle(hf, ids: list[int], k: int) -> tuple[list[float], list[list[int]], list[int]]:
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    target = torch.tensor(ids[1:]).unsqueeze(1)
    chosen = logp.gather(1, target).view(-1)
    ranks = ((logp > chosen.unsqueeze(1)).sum(-1) + 1).tolist()
    return chosen.tolist(), logp.topk(k, dim=-1).indices.tolist(), ranks


def check(out, hf, k: int) -> None:
    ids = out.prompt_token_ids
    chosen, top, ranks = oracle(hf, ids, k)
    got = out.prompt_logprobs
    assert [lp.token_id for lp in got] == ids[1:]
    assert max(abs(lp.logprob - c) for lp, c in zip(got, chosen)) < 1e-4
    assert [lp.rank for lp in got] == ranks
    assert [[t for t, _ in lp.top] for lp in got] == top


@pytest.mark.parametrize("budget", [16, 512], ids=["chunked", "one-chunk"])
def test_prompt_logprobs_are_transformers(demo_model, hf, budget):
    eng = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8, max_num_batched_tokens=budget))
    outs = eng.generate([PROMPT, "Hello"], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                                             SamplingParams(max_tokens=2, temperature=0)])
    check(outs[0], hf, 3)
    assert outs[1].prompt_logprobs is None


def test_a_cached_prefix_is_scored_all_the_same(demo_model, hf):
    eng = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8))
    eng.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))  # fills the prefix cache
    hits = eng.blocks.prefix_hits
    out = eng.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    check(out, hf, 1)
    assert eng.blocks.prefix_hits == hits, "a request for prompt logprobs computes its whole prompt"


def test_a_preempted_request_scores_each_prompt_token_once(demo_model, hf):
    prompts = [PROMPT, "The router sends each request to a worker", "Roses are red", "SELECT name FROM students"]
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, prompt_logprobs=0)
    tight = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8, num_kv_blocks=12, enable_prefix_caching=False))
    outs = tight.generate(prompts, sp)
    assert tight.scheduler.preempted_total > 0
    for out in outs:
        check(out, hf, 0)


def test_a_prefill_preempted_midway_scores_each_prompt_token_once(demo_model, hf):
    """A long prompt prefilled in chunks of 8 into 12 blocks of 8: the requests beside it take the
    blocks it needs, it is preempted with its prompt partly scored, and resumes where it was."""
    long = " ".join(["once upon a time"] * 7)  # 55 tokens; the newest request, so the one preempted
    prompts = ["Roses are red", "SELECT name FROM students", "The router sends each request", long]
    sp = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    tight = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8, num_kv_blocks=12,
                                               max_num_batched_tokens=8, enable_prefix_caching=False))
    partly: list[int] = []
    preempt = tight.scheduler._preempt

    def spy(seq, batch):
        if seq.sampling.prompt_logprobs is not None:
            partly.append(len(seq.prompt_lps))
        preempt(seq, batch)

    tight.scheduler._preempt = spy
    out = tight.generate(prompts, sp)[-1]
    assert any(0 < k < len(out.prompt_token_ids) - 1 for k in partly), partly
    check(out, hf, 1)


def test_scored_rows_are_bounded_per_step_over_all_requests(demo_model, hf, monkeypatch):
    """Each scored prompt token keeps a vocabulary-wide row of logits: a step scores at most
    PROMPT_SCORING_CHUNK prompt tokens over all its requests, whatever its token budget."""
    from lorafleet.worker.engine import model_runner, scheduler

    monkeypatch.setattr(scheduler, "PROMPT_SCORING_CHUNK", 5)
    rows: list[int] = []
    score = model_runner._score_prompt
    monkeypatch.setattr(model_runner, "_score_prompt", lambda logits, r: (rows.append(len(r)), score(logits, r))[1])
    eng = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8, max_num_batched_tokens=512))
    prompts = [PROMPT, "The router sends each request to a worker", "Roses are red, violets are blue"]
    outs = eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    assert rows and max(rows) <= 5
    for out in outs:
        check(out, hf, 0)

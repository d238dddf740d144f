"""Prompt logprobs (vLLM's `prompt_logprobs`, and what completions' echo with logprobs returns): each
prompt token's logprob given the tokens before it, against transformers (fp32, CPU), whether the
prompt is computed in one chunk or several, twice in a row (no prefix-cache hit may skip a
position), or recomputed after a preemption (no position scored twice)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine import LLMEngine
from lorafleet.worker.sequence import SamplingParams

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


def test_scoring_steps_are_capped_whatever_the_token_budget(demo_model, hf, monkeypatch):
    """Each scored prompt token keeps a vocabulary-wide row of logits: a prompt is scored at most
    PROMPT_SCORING_CHUNK tokens a step, while a plain request takes the whole budget."""
    from lorafleet.worker import scheduler

    monkeypatch.setattr(scheduler, "PROMPT_SCORING_CHUNK", 5)
    eng = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8, max_num_batched_tokens=512))
    chunks: list[int] = []
    schedule = eng.scheduler.schedule

    def spy():
        batch = schedule()
        chunks.extend(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.sampling.prompt_logprobs is not None)
        return batch

    eng.scheduler.schedule = spy
    out = eng.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1))[0]
    check(out, hf, 1)
    prefill = [n for n in chunks if n > 1]
    assert max(chunks) == 5 and sum(prefill) + (len(chunks) - len(prefill)) >= len(out.prompt_token_ids)

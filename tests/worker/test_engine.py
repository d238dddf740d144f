"""Engine behaviour: preemption, prefix caching, sampling knobs, limits and errors."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine, RequestError
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.lora.registry import AdapterNotFound

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello world", "The router sends each request", "Roses are red", "SELECT name FROM students"]
ADAPTERS = [(), (("sql", 1.0),), (("chat", 1.0),), (("poem", 0.8), ("sql", 0.5))]


@pytest.fixture(scope="module")
def engine(demo_model, modules):
    return LLMEngine(demo_model, EngineConfig(max_loras=4, max_cpu_loras=8), lora_modules=modules)


def test_preemption_and_resume_give_the_same_tokens(demo_model, modules, engine):
    want = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, ADAPTERS)]
    # 7 blocks of 8 tokens cannot hold four growing requests: some are preempted and recomputed.
    tight = LLMEngine(demo_model, EngineConfig(max_loras=4, max_cpu_loras=8, block_size=8, num_kv_blocks=7,
                                               enable_prefix_caching=False), lora_modules=modules)
    got = [o.token_ids for o in tight.generate(PROMPTS, GREEDY, ADAPTERS)]
    assert tight.scheduler.preempted_total > 0
    assert got == want
    assert tight.blocks.num_free == tight.blocks.num_blocks


def test_prefix_cache_hits_give_identical_logits(demo_model, modules):
    eng = LLMEngine(demo_model, EngineConfig(max_loras=4, block_size=8), lora_modules=modules)
    prompt = "Once upon a time there was a model with many adapters, and every tenant was happy."
    rows = []
    eng.logits_hook = lambda seqs, logits: rows.append(logits.clone())
    first = eng.generate([prompt], GREEDY, [(("sql", 1.0),)])[0]
    hits_before = eng.blocks.prefix_hits
    n_first = len(rows)
    second = eng.generate([prompt], GREEDY, [(("sql", 1.0),)])[0]
    assert eng.blocks.prefix_hits > hits_before  # the second run reused cached blocks
    assert second.token_ids == first.token_ids
    torch.testing.assert_close(torch.stack(rows[n_first:]), torch.stack(rows[:n_first]), rtol=1e-5, atol=1e-5)
    hits = eng.blocks.prefix_hits
    eng.generate([prompt], GREEDY, [(("chat", 1.0),)])  # other adapter: no sharing
    assert eng.blocks.prefix_hits == hits


def test_seeded_sampling_repeats_and_differs_across_seeds(engine):
    def run(seed):
        sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)
        return engine.generate(["Hello world"] * 2, sp, [(), (("chat", 1.0),)])

    a, b, c = run(1), run(1), run(2)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(["Hello world"], GREEDY)[0].token_ids
    topk1 = engine.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True))[0]
    assert topk1.token_ids == greedy


def test_stop_strings_and_ids(engine):
    base = engine.generate(["Hello world"], GREEDY)[0]
    stop_text = base.text[3:6]
    assert stop_text
    out = engine.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop_text,)))[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.index(stop_text)]
    sid = base.token_ids[4]
    out = engine.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(sid,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(sid) + 1]


def test_logprobs_are_the_models_distribution(engine):
    rows = []
    engine.logits_hook = lambda seqs, logits: rows.append(logits.clone())
    out = engine.generate(["Hello world"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    engine.logits_hook = None
    for lp, logits in zip(out.logprobs, rows):
        ref = torch.log_softmax(logits[0], -1)
        assert lp.token_id == int(ref.argmax())
        assert abs(lp.logprob - float(ref.max())) < 1e-5
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_max_loras_defers_in_the_engine(demo_model, modules):
    eng = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=8), lora_modules=modules)
    seen = []
    eng.logits_hook = lambda seqs, logits: seen.append({n for s in seqs for n in s.adapter_names})
    adapters = [(("sql", 1.0),), (("chat", 1.0),), (("poem", 1.0),), (("code", 1.0),), ()]
    outs = eng.generate(["Hello world"] * 5, GREEDY, adapters)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert eng.scheduler.deferred_total > 0
    assert max(len(s) for s in seen) <= 2


def test_request_errors(engine):
    with pytest.raises(AdapterNotFound):
        engine.add_request("hi", GREEDY, [("nope", 1.0)])
    with pytest.raises(RequestError, match="max_loras_per_request") as info:
        engine.add_request("hi", GREEDY, [("sql", 1.0), ("chat", 1.0), ("poem", 1.0), ("code", 1.0), ("legal", 1.0)])
    assert info.value.param == "lora_adapters"
    with pytest.raises(RequestError, match="context length"):
        engine.add_request("hi", SamplingParams(max_tokens=10_000))
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([10**6])
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not engine.has_unfinished()
    assert all(e.in_flight == 0 for e in engine.registry.entries.values())


def test_stop_token_ids_are_capped_and_checked_against_the_vocabulary(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="at most 64"):
        SamplingParams(stop_token_ids=(7,) * 65)
    for bad in ((vocab,), (3, -1)):
        with pytest.raises(RequestError, match=f"stop_token_ids must be in 0..{vocab - 1}"):
            engine.add_request("hi", SamplingParams(stop_token_ids=bad))
    assert not engine.has_unfinished()
    assert all(e.in_flight == 0 for e in engine.registry.entries.values())


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_outside_torchs_range_is_refused_with_its_request(seed):
    with pytest.raises(ValueError, match="seed must be in -9223372036854775808..18446744073709551615"):
        SamplingParams(seed=seed)


def test_a_generator_that_cannot_be_seeded_fails_its_request_only(engine, monkeypatch):
    """Defence in depth: a seeded request gets its generator when it is queued, so a seed torch
    refuses fails that request (RequestError), never the step that would have sampled it."""
    def refuse(seq):
        raise RuntimeError("no generator for you")

    monkeypatch.setattr(engine.runner, "generator_for", refuse)
    with pytest.raises(RequestError, match="seed 5.*no generator for you"):
        engine.add_request("hi", SamplingParams(seed=5), [("sql", 1.0)])
    monkeypatch.undo()
    assert not engine.has_unfinished() and engine.registry.entries["sql"].in_flight == 0
    assert not engine.runner._generators
    out = engine.generate(["hi"], SamplingParams(max_tokens=4, seed=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_text_that_cannot_fit_is_refused_before_tokenizing(engine, monkeypatch):
    limit = engine.max_prompt_chars
    assert limit == engine.max_model_len * engine.tokenizer.max_token_chars
    longest = max(range(engine.tokenizer.vocab_size), key=lambda t: len(engine.tokenizer.id_to_token(t)))
    # Even text made of the longest token only needs more than max_model_len tokens past the limit.
    piece = engine.tokenizer.decode([longest], skip_special_tokens=False)
    assert len(engine.tokenizer.encode(piece * (limit // len(piece) + 1), add_special_tokens=False)) > engine.max_model_len
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(RequestError, match=f"at most {limit} characters"):
        engine.add_request("x" * (limit + 1))


def test_abort_frees_blocks_and_adapter(engine):
    rid = engine.add_request("Hello world", GREEDY, [("sql", 1.0)])
    engine.step()
    assert engine.registry.entries["sql"].in_flight == 1
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.registry.entries["sql"].in_flight == 0
    assert engine.blocks.usage() == 0.0 or engine.blocks.num_free == engine.blocks.num_blocks


def test_pinned_adapters_do_not_block_other_adapters(demo_model, modules):
    # Two pinned adapters fill both GPU slots; a request for a third must still run.
    eng = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=8, pinned_adapters=("chat", "code")),
                    lora_modules=modules)
    eng.generate(["hi", "hi"], GREEDY, [(("chat", 1.0),), (("code", 1.0),)])
    out = eng.generate(["hi"], GREEDY, [(("legal", 1.0),)])[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    assert {"chat", "code"} <= set(eng.registry.cpu)


def test_prefix_counters_count_admitted_lookups_only(demo_model, modules):
    # A KV cache too small for both prompts at once: the second admission is undone and retried.
    eng = LLMEngine(demo_model, EngineConfig(max_loras=2, block_size=8, num_kv_blocks=8, enable_prefix_caching=True),
                    lora_modules=modules)
    prompts = [[5 + i for i in range(40)], [90 + i for i in range(40)]]
    eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert eng.blocks.prefix_queries <= sum(len(p) for p in prompts) * 2  # each admitted at most ~once
    assert eng.blocks.prefix_hits <= eng.blocks.prefix_queries


def test_non_finite_logits_end_only_that_request(engine):
    poisoned = []

    def poison(seqs, logits):
        if not poisoned:
            poisoned.append(seqs[0].seq_id)
            logits[0].fill_(float("nan"))

    engine.logits_hook = poison
    try:
        outs = engine.generate(["Hello world", "Roses are red"], GREEDY, [(("sql", 1.0),), ()])
    finally:
        engine.logits_hook = None
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == GREEDY.max_tokens
    assert engine.registry.entries["sql"].in_flight == 0 and not engine.has_unfinished()


def test_a_logits_hook_edits_what_a_graph_decode_step_samples(demo_model, modules):
    """In decode steps from the graph path (here uncaptured, on CPU) the hook gets float32 logits
    and the tokens come from them as edited, not from the graph's own greedy pick."""
    engine = LLMEngine(demo_model, EngineConfig(max_loras=2, cuda_graphs=True), lora_modules=modules)
    assert engine.runner.graphs is not None
    seen = []

    def poison(seqs, logits):
        seen.append(logits.dtype)
        if engine.runner.graphs.stats.replays and len(seen) == 3:  # a decode step from the graph path
            logits[1].fill_(float("nan"))

    engine.logits_hook = poison
    outs = engine.generate(["Hello world", "Roses are red"], GREEDY, [(("sql", 1.0),), ()])
    assert set(seen) == {torch.float32} and engine.runner.graphs.stats.replays > 0
    assert outs[1].finish_reason == "error" and outs[0].finish_reason == "length"
    assert 0 < len(outs[1].token_ids) < GREEDY.max_tokens


def test_slots_store_b_rank_major(demo_model, modules):
    from lorafleet.kernels.lora.operands import lora_b_layout

    engine = LLMEngine(demo_model, EngineConfig(max_loras=2), lora_modules={"sql": modules["sql"]})
    assert lora_b_layout(engine.slots.layers[0]["qkv_proj"].lora_b[0]) == "rank_major"

"""The engine's greedy decoding with penalties, logit_bias, min_tokens and allowed_token_ids, all in
one batch, against transformers `generate` with the same knobs (fp32 on CPU), and a manual
transformers loop with OpenAI's formula for the frequency and presence penalties, which
transformers lacks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine, RequestError
from lorafleet.worker.engine.sequence import SamplingParams

pytest.importorskip("transformers")

from .peft_oracle import load_hf_base  # noqa: E402

EOS = 1  # the demo model's
# Greedy decoding of the first and fourth repeats itself, so the penalties there change the tokens.
PROMPTS = ["Hello world", "SELECT name FROM students", "Roses are red", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def hf(demo_model):
    return load_hf_base(demo_model)


@pytest.fixture(scope="module")
def engine(demo_model):
    return LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=16))


def hf_generate(hf, ids: list[int], max_new: int, **knobs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS,
                          pad_token_id=2, **knobs)
    return out[0, len(ids):].tolist()


def hf_openai_penalties(hf, ids: list[int], max_new: int, frequency: float, presence: float) -> list[int]:
    """transformers' logits, then OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = hf(torch.tensor([ids + out])).logits[0, -1].clone()
            for token, count in Counter(out).items():
                logits[token] -= count * frequency + presence
            out.append(int(logits.argmax()))
    return out


def test_one_batch_of_edited_requests_decodes_as_transformers(engine, hf):
    tok = engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    n = 10
    base = dict(max_tokens=n, temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(**base, repetition_penalty=1.8),
        SamplingParams(**base, repetition_penalty=0.6),
        SamplingParams(**base, logit_bias=((7, 3.0), (40, 2.5), (300, -100.0))),
        SamplingParams(**base, frequency_penalty=1.2, presence_penalty=0.4),
        SamplingParams(**base),  # plain, in the same batch
    ]
    outs = engine.generate(PROMPTS, params)
    assert outs[0].token_ids == hf_generate(hf, ids[0], n, repetition_penalty=1.8)
    assert outs[1].token_ids == hf_generate(hf, ids[1], n, repetition_penalty=0.6)
    assert outs[2].token_ids == hf_generate(hf, ids[2], n, sequence_bias={(7,): 3.0, (40,): 2.5, (300,): -100.0})
    assert outs[3].token_ids == hf_openai_penalties(hf, ids[3], n, 1.2, 0.4)
    assert outs[4].token_ids == hf_generate(hf, ids[4], n)
    # The knobs changed what was decoded (else the comparisons above prove little).
    plain = engine.generate(PROMPTS[:4], SamplingParams(**base))
    assert all(o.token_ids != p.token_ids for o, p in zip(outs, plain))


def test_min_tokens_holds_eos_back_as_transformers_does(engine, hf):
    """EOS pushed up by logit_bias ends a request at once, unless min_tokens holds it back."""
    ids = engine.tokenizer.encode(PROMPTS[0])
    pushed = ((EOS, 8.0),)
    early = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, logit_bias=pushed))[0]
    assert early.token_ids == [EOS] and early.finish_reason == "stop"
    held = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, logit_bias=pushed, min_tokens=5))[0]
    assert held.token_ids == hf_generate(hf, ids, 12, min_new_tokens=5, sequence_bias={(EOS,): 8.0})
    assert len(held.token_ids) == 6 and held.token_ids[-1] == EOS and held.finish_reason == "stop"


def test_stop_strings_count_only_after_min_tokens(engine):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = engine.generate([PROMPTS[1]], sp)[0]
    first = engine.tokenizer.decode(free.token_ids[:1])
    assert first.strip(), "the first token should have text to stop on"
    stop = first.strip()[:2]
    cut = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) == 1
    held = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=(stop,),
                                                        min_tokens=3))[0]
    assert len(held.token_ids) > 3 and held.token_ids == free.token_ids[: len(held.token_ids)]


def test_allowed_token_ids_are_all_that_is_sampled(engine):
    allowed = (5, 77, 301)
    outs = engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed),
                                         SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=allowed)])
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
    assert len(outs[0].token_ids) == 12


@pytest.mark.parametrize("knobs,message", [
    (dict(logit_bias=((512, 1.0),)), "logit_bias must be in 0..511"),
    (dict(allowed_token_ids=(3, 600)), "allowed_token_ids must be in 0..511"),
    (dict(allowed_token_ids=(EOS,), min_tokens=2), "every token in allowed_token_ids is a stop token"),
])
def test_token_ids_outside_the_vocabulary_are_refused(engine, knobs, message):
    with pytest.raises(RequestError, match=message):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, **knobs))


def test_finished_requests_free_their_rows(engine):
    procs = engine.runner.logits_processors
    engine.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, presence_penalty=0.5))
    assert procs.rows_in_use == 0


def test_a_refused_request_releases_its_adapters(demo_model, demo_adapters):
    """The allowed-are-all-stop-tokens check came after the adapters were taken: each such request
    left its adapter counted in flight for good (never idle, never dropped once removed)."""
    eng = LLMEngine(demo_model, EngineConfig(dtype="float32"), lora_modules={"sql": str(demo_adapters["sql"])})
    with pytest.raises(RequestError, match="every token in allowed_token_ids is a stop token"):
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, allowed_token_ids=(EOS,), min_tokens=2), [("sql", 1.0)])
    assert eng.registry.entries["sql"].in_flight == 0


def test_preempted_requests_give_back_their_rows_and_resume_alike(demo_model):
    """7 blocks of 8 tokens cannot hold five growing requests: some are preempted, give their rows
    back, rebuild them from their tokens when they resume, and decode as without preemption."""
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
                             repetition_penalty=1.4 - 0.1 * i) for i in range(len(PROMPTS))]
    roomy = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8))
    want = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    tight = LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=8, num_kv_blocks=7, enable_prefix_caching=False))
    procs = tight.runner.logits_processors
    forgotten = []
    forget = procs.forget
    procs.forget = lambda seq: (forgotten.append(seq.seq_id), forget(seq))[1]
    got = [o.token_ids for o in tight.generate(PROMPTS, params)]
    assert tight.scheduler.preempted_total > 0 and len(forgotten) > len(PROMPTS), "rows freed on preemption too"
    assert got == want and procs.rows_in_use == 0


def a_two_token_word(tok, ids: list[int]) -> tuple[str, tuple[int, int]]:
    """Text of two consecutive tokens of `ids` that encodes back to those two tokens."""
    for a, b in zip(ids, ids[1:]):
        text = tok.decode([a, b])
        if text.strip() and tuple(tok.encode(text.lstrip(), add_special_tokens=False)) == (a, b):
            return text, (a, b)
    raise AssertionError(f"no two-token word in {ids}")


def test_bad_words_are_never_generated_as_transformers_bans_them(engine, hf):
    """vLLM's bad_words: a one-token word is never sampled, a longer one's last token is banned
    where the output ends with the rest of it. Oracle: transformers' generate with the same token
    sequences (`bad_words_ids`), the prompt's tail matching none of them (transformers also
    matches across the prompt, vLLM and we only the output)."""
    tok = engine.tokenizer
    base = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = engine.generate(PROMPTS[:2], SamplingParams(**base))
    two_text, two = a_two_token_word(tok, plain[0].token_ids[2:])
    one_text = next(text for t in plain[1].token_ids if (text := tok.decode([t])) == text.lstrip() and text
                    and tok.encode(text, add_special_tokens=False) == [t])
    params = [SamplingParams(**base, bad_words=(two_text,)), SamplingParams(**base, bad_words=(one_text,))]
    rids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
    seqs = [engine._tracked[r].seq for r in rids]
    while engine.has_unfinished():
        engine.step()
    assert two in seqs[0].bad_word_ids
    for seq, before in zip(seqs, plain):
        assert seq.output_ids != before.token_ids, "the bad word was in the plain output"
        assert not any(seq.prompt_ids[len(seq.prompt_ids) - len(w) + 1 :] == list(w[:-1]) for w in seq.bad_word_ids if len(w) > 1)
        want = hf_generate(hf, seq.prompt_ids, 10, bad_words_ids=[list(w) for w in seq.bad_word_ids])
        assert seq.output_ids == want
    assert all(w[0] not in seqs[1].output_ids for w in seqs[1].bad_word_ids if len(w) == 1)


def test_bad_words_tokenize_as_vllm_does(engine):
    from lorafleet.worker.sampling.logits_processors import bad_word_ids

    tok = engine.tokenizer
    got = bad_word_ids(tok, ["  name", "students"])
    plain, spaced = tuple(tok.encode("name", add_special_tokens=False)), tuple(tok.encode(" name", add_special_tokens=False))
    assert got[0] == plain and (spaced in got) == (spaced[0] != plain[0] and len(spaced) == len(plain))
    assert tuple(tok.encode("students", add_special_tokens=False)) in got


def test_requests_with_long_bad_words_sample_after_the_step_before_under_async(demo_model):
    """Their tail match needs the host's tokens: under async scheduling such a batch's steps are
    sampled once the step before is read (AsyncStepper), and give what the synchronous engine gives."""
    kw = dict(cuda_graphs=True, warmup=False, dtype="float32")
    sync = LLMEngine(demo_model, EngineConfig(async_scheduling=False, **kw))
    asyn = LLMEngine(demo_model, EngineConfig(async_scheduling=True, **kw))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = [o.token_ids for o in sync.generate(PROMPTS, plain)]
    tok = sync.tokenizer
    word, _ = a_two_token_word(tok, before[0])  # a word the first request would generate
    banned = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words=(word,))
    params = [banned, plain, plain, plain, plain]  # one request with it among plain ones
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    got = [o.token_ids for o in asyn.generate(PROMPTS, params)]
    stats = asyn.async_steps.stats
    assert got == want and got[0] != before[0] and stats.deferred > 0 and stats.deferred == stats.overlapped
    deferred = stats.deferred
    asyn.generate(PROMPTS, plain)
    assert stats.overlapped > deferred and stats.deferred == deferred, "without them nothing is deferred"


def test_bad_words_outside_the_models_vocabulary_are_a_400(engine, monkeypatch):
    """A tokenizer can hold more tokens than the model's vocabulary: such a word is refused, not
    indexed past the edit row (a device-side assert on CUDA)."""
    import dataclasses

    word = next(t for t in range(300, 512) if (text := engine.tokenizer.decode([t])) == text.strip() and text
                and engine.tokenizer.encode(text, add_special_tokens=False) == [t])
    monkeypatch.setattr(engine, "model_config", dataclasses.replace(engine.model_config, vocab_size=300))
    with pytest.raises(RequestError, match="bad_words: a word has tokens outside the model's vocabulary"):
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, bad_words=(engine.tokenizer.decode([word]),)))

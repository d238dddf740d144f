"""Structured outputs (worker/sampling/structured.py): the engine's answers under a choice list, a regex, a JSON
schema and any JSON object, checked against the constraint itself (Python's `re` and `json`, not
xgrammar); unconstrained requests in the same batch unchanged; bad constraints are 400s naming their
field; the API's response_format, guided_* and structured_outputs spellings."""

from __future__ import annotations

import json
import re

import pytest

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.sampling.structured import Constraint
from tests.worker.test_api_openai_compat import post, refused
from tests.worker.worker_harness import CHAT, PROMPT

pytest.importorskip("xgrammar")

PROMPTS = ["Hello world", "SELECT name FROM students", "Roses are red", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(demo_model):
    return LLMEngine(demo_model, EngineConfig(dtype="float32", block_size=16))


def run(engine, constraint: Constraint | None, max_tokens: int = 48, **knobs) -> list:
    knobs = {"temperature": 1.0, "seed": 7, **knobs}
    params = [SamplingParams(max_tokens=max_tokens, constraint=constraint, **{**knobs, "seed": knobs["seed"] + i})
              for i in range(len(PROMPTS))]
    return engine.generate(PROMPTS, params)


def test_choice(engine):
    options = ["red", "green", "light blue", "a (b)"]
    outs = run(engine, Constraint.choice(options, "guided_choice"))
    assert all(o.text in options and o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]


def test_a_constraint_after_a_token_holds_from_the_next(engine):
    """SamplingParams.constraint_after (a reasoning model's `</think>`): the tokens up to and
    including it are the unconstrained run's (same seeds), the rest is the constraint's."""
    options = ["red", "green", "light blue"]
    for i, prompt in enumerate(PROMPTS):  # one at a time: the same batch for both runs
        ids = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i))[0].token_ids
        j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])  # its first sampling ends the wait
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=7 + i, constraint_after=ids[j],
                                constraint=Constraint.choice(options, "guided_choice"))
        out = engine.generate([prompt], params)[0]
        assert out.token_ids[: j + 1] == ids[: j + 1]
        assert engine.tokenizer.decode(out.token_ids[j + 1 :]) in options and out.finish_reason == "stop"


def test_regex(engine):
    outs = run(engine, Constraint("regex", r"[0-9]{3}-[a-z]{2}", "guided_regex"))
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", o.text) and o.finish_reason == "stop" for o in outs), \
        [o.text for o in outs]


def test_json_schema(engine):
    outs = run(engine, Constraint.schema(SCHEMA, "guided_json"), max_tokens=64)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        value = json.loads(o.text)
        assert set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool)
        assert value["color"] in ("red", "green", "blue") and isinstance(value["n"], int) and 0 <= value["n"] <= 99


def test_any_json_object(engine):
    """The random demo model may not close its object in time: what stops is a JSON object, what
    runs out of tokens is the start of one."""
    outs = run(engine, Constraint("json_object", "", "response_format"), max_tokens=40)
    for o in outs:
        assert o.text.lstrip().startswith("{"), o.text
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_free_requests_in_the_same_batch_are_unchanged(engine):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = engine.generate(PROMPTS[:2], [free, free])
    bound = SamplingParams(max_tokens=12, temperature=0.0, constraint=Constraint.choice(["yes", "no"], "guided_choice"))
    mixed = engine.generate(PROMPTS[:2] + PROMPTS[:2], [free, free, bound, bound])
    assert [o.text for o in mixed[:2]] == [o.text for o in alone]
    assert all(o.text in ("yes", "no") for o in mixed[2:])


def test_mask_filler_rows_are_each_matchers_own_mask(engine):
    """MaskFiller (one buffer reused, the batch fill from BATCH_FILL_ROWS rows) against xgrammar's
    fill of each matcher alone, over steps whose constrained rows, count and batch size change."""
    import torch
    import xgrammar as xgr

    from lorafleet.worker.sampling.structured import BATCH_FILL_ROWS, MaskFiller

    vocab = engine.model_config.vocab_size
    kinds = [Constraint.choice(["yes", "no"], "guided_choice"), Constraint("regex", "[0-9]{2,9}", "guided_regex"),
             Constraint.schema(SCHEMA, "guided_json"), Constraint("json_object", "", "response_format")]
    matchers = [engine.grammars.matcher(kinds[i % 4], frozenset({1}), False) for i in range(9)]
    filler = MaskFiller(vocab, engine.device)
    gen = torch.Generator().manual_seed(3)
    for batch, rows in [(3, [0, 2]), (12, list(range(1, 10))), (12, [11, 4, 0, 7]), (5, [4])]:
        picked = [(row, matchers[j]) for j, row in enumerate(rows)]
        got = filler.fill(picked, batch).cpu()
        for row, m in picked:
            want = xgr.allocate_token_bitmask(1, vocab)
            m.fill_next_token_bitmask(want, 0)
            assert torch.equal(got[row], want[0]), (batch, row)
        for _, m in picked:  # advance each matcher by a token its mask allows
            mask = xgr.allocate_token_bitmask(1, vocab)
            m.fill_next_token_bitmask(mask, 0)
            allowed = [t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1 and t != 1]  # 1: EOS
            if allowed:  # (a finished choice takes only EOS: it keeps its state)
                assert m.accept_token(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
    assert len(range(1, 10)) >= BATCH_FILL_ROWS  # the batch fill ran in one step


# -- the API --------------------------------------------------------------------------------------------


def test_response_format_json_schema_from_the_official_client(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=64, seed=3, response_format=fmt)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok", "color", "n"} and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields", [
    {"guided_choice": ["alpha", "beta"]},
    {"structured_outputs": {"choice": ["alpha", "beta"]}},
    {"guided_regex": "(alpha|beta)"},
    {"structured_outputs": {"regex": "(alpha|beta)"}},
])
def test_vllm_spellings_in_completions_streamed_and_not(client, fields):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, seed=1, n=2, extra_body=fields)
    assert all(c.text in ("alpha", "beta") for c in r.choices)
    chunks = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, seed=1, stream=True, extra_body=fields)
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("alpha", "beta")


@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"lark": "start: 'a'"}}, "structured_outputs.lark"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": "alpha"}}, "structured_outputs.choice"),
    ({"guided_grammar": "this is not a grammar ::= ("}, "guided_grammar"),
])
def test_bad_constraints_are_400s_naming_the_field(worker, fields, param):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 4, **fields}
    refused(post(worker, "chat/completions", body), param)


def test_a_known_constraint_of_the_wrong_type_says_so(worker):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 4, "structured_outputs": {"regex": 5}}
    assert refused(post(worker, "chat/completions", body), "structured_outputs.regex") == \
        "structured_outputs.regex must be a string"


def test_text_response_format_changes_nothing(worker):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 6, "temperature": 0}
    plain = post(worker, "chat/completions", body).json()["choices"][0]["message"]["content"]
    text = post(worker, "chat/completions", {**body, "response_format": {"type": "text"}}).json()
    assert text["choices"][0]["message"]["content"] == plain


def test_ignore_eos_ends_with_the_grammar(engine):
    """Without EOS the matcher ends with the grammar itself, and so does the answer."""
    outs = run(engine, Constraint.choice(["yes", "no"], "guided_choice"), ignore_eos=True)
    assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in outs), [o.text for o in outs]

"""Function calling (worker/openai/tools.py, worker/openai/tool_parsers.py): a named tool_choice and "required"
come back as OpenAI's `tool_calls`, their arguments held to the tools' schemas (checked with `json`),
from the official client, streamed and not (streamed: the arguments piece by piece, put together by
the `openai` library's own stream reader); what cannot be honoured is a 400 naming the field; tools
and earlier tool turns reach the chat template; "auto" reads the hermes, llama3_json, mistral and pythonic formats."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from lorafleet.worker.engine.tokenizer import Tokenizer
from tests.worker.test_api_openai_compat import post, refused
from tests.worker.worker_harness import CHAT

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "weather"}}


def valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "weather":
        return set(args) == {"city", "unit"} and args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")
    return name == "clock" and set(args) == {"utc"} and isinstance(args["utc"], bool)


def test_a_named_tool_is_called(client):
    r = client.chat.completions.create(model="sql", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice=NAMED,
                                       max_tokens=64, n=2, seed=5)
    for c in r.choices:
        assert c.message.content is None and c.finish_reason == "stop"  # OpenAI's, for a forced call
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
        assert valid(call.function.name, call.function.arguments), call.function.arguments


def test_required_calls_one_or_more_tools(client):
    r = client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required",
                                       max_tokens=160, n=3, seed=2)
    for c in r.choices:
        calls = c.message.tool_calls
        if c.finish_reason == "length":  # the random demo model may write a long array: the last call cut short
            assert calls and all(valid(t.function.name, t.function.arguments) for t in calls[:-1])
            continue
        assert c.finish_reason == "tool_calls" and calls and c.message.content is None
        assert all(valid(t.function.name, t.function.arguments) for t in calls)


def test_a_call_cut_short_comes_back_cut_short(client):
    """Out of tokens inside the arguments: the call as far as it was written, finish_reason
    "length" (OpenAI's)."""
    r = client.chat.completions.create(**CUT_SHORT)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and call.function.name == "weather"
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)


CUT_SHORT = dict(model="demo", messages=CHAT, tools=[WEATHER], tool_choice=NAMED, max_tokens=4, seed=1)


def test_one_call_when_parallel_calls_are_off(client):
    """The same seeded choices make several calls with parallel calls on (the default) and one each
    with them off."""
    def counts(**kw) -> list[int]:
        r = client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required",
                                           max_tokens=200, n=4, seed=0, **kw)
        return [len(c.message.tool_calls or []) for c in r.choices if c.finish_reason == "tool_calls"]

    assert max(counts()) > 1
    off = counts(parallel_tool_calls=False)
    assert off and set(off) == {1}


def streamed_completion(chunks, tools=(WEATHER, CLOCK)):
    """The completion the `openai` library puts together from a stream's chunks (the oracle for how
    they fit: each call's deltas merged by index); also checks each call's first delta names it."""
    state, seen = ChatCompletionStreamState(input_tools=list(tools)), set()
    for chunk in chunks:
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for t in choice.delta.tool_calls or []:
                if (choice.index, t.index) not in seen:
                    assert t.id and t.function.name and t.type == "function", t
                    seen.add((choice.index, t.index))
                else:
                    assert t.id is None and t.function.name is None, t  # one call, one id and name
    return state.current_completion_snapshot  # get_final_completion refuses finish_reason "length"


def test_a_streamed_call_arrives_as_it_is_written(client):
    """The named call's arguments come in several pieces, the first delta naming the call."""
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER], tool_choice=NAMED,
                                                 max_tokens=64, seed=1, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert len([t for d in deltas for t in (d.tool_calls or [])]) > 2 and not any(d.content for d in deltas)
    final = streamed_completion(chunks).choices[0]
    (call,) = final.message.tool_calls
    assert final.finish_reason == "stop" and call.function.name == "weather" and valid("weather", call.function.arguments)


@pytest.mark.parametrize("kw", [
    dict(model="demo", messages=CHAT, tools=[WEATHER], tool_choice=NAMED, max_tokens=64, seed=1),
    dict(model="demo", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200, n=4, seed=0),
    CUT_SHORT,
], ids=["named", "required", "cut_short"])
def test_streamed_calls_are_the_whole_answers(client, kw):
    """The same seeded request, streamed and not: the same calls, arguments and finish_reasons."""
    final = streamed_completion(client.chat.completions.create(**kw, stream=True))
    whole = client.chat.completions.create(**kw)
    if kw["tool_choice"] == "required":
        assert any(len(c.message.tool_calls or []) > 1 for c in whole.choices)
    for got, want in zip(sorted(final.choices, key=lambda c: c.index), whole.choices, strict=True):
        assert got.finish_reason == want.finish_reason and want.message.tool_calls
        assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls or []] == [
            (t.function.name, t.function.arguments) for t in want.message.tool_calls]


def test_tool_choice_none_answers_in_text(worker):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "none"}
    r = post(worker, "chat/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text


@pytest.mark.parametrize("fields,param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default: needs a parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, "tools.0"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "guided_regex": "a"}, "tool_choice"),
])
def test_what_cannot_be_honoured_is_a_400(worker, fields, param):
    refused(post(worker, "chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 4, **fields}), param)


def test_tools_and_tool_turns_reach_the_template(demo_model, tmp_path):
    """A template that prints its tools and the earlier turn's call and answer (as tool-calling
    models' templates do) sees them."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((demo_model / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                               "{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}"
                               "{% endif %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from lorafleet.worker.openai.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": [WEATHER, CLOCK]})
    text = Tokenizer(tmp_path).apply_chat_template(body.template_messages(), tools=body.tools)
    assert text == f"[weather][clock]user:{CHAT[0]['content']};assistant:weather;tool:sunny#c1;"


def test_completions_still_refuse_tools(worker):
    refused(post(worker, "completions", {"model": "demo", "prompt": "x", "max_tokens": 2, "tools": [WEATHER]}), "tools")


def test_the_official_client_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER], max_tokens=2)
    assert err.value.body["param"] == "tool_choice"


# -- "auto" with --tool-call-parser hermes --------------------------------------------------------------

HERMES_CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'


def parsing_worker(demo_model, demo_adapters, parser: str, **kw):
    """A served worker started with --tool-call-parser `parser` (a fixture's body)."""
    import dataclasses

    from tests.worker.worker_harness import RunningWorker, worker_settings

    w = RunningWorker(dataclasses.replace(worker_settings(demo_model, demo_adapters, **kw), tool_call_parser=parser))
    yield w.start()
    w.stop()


@pytest.fixture(scope="module")
def auto_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "hermes")


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "{}.[]()" else ch for ch in text)


def auto_calls(worker, text: str) -> list[dict]:
    """The demo model made to write `text` (a regex holds it) under "auto": the answer's tool_calls
    (content null, finish_reason tool_calls), checked to be the streamed answer's too (through the
    official client)."""
    body = {"model": "demo", "messages": CHAT, "tools": [WEATHER, CLOCK], "max_tokens": 240, "guided_regex": _regex(text)}
    r = post(worker, "chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER, CLOCK], max_tokens=240,
                                                 stream=True, extra_body={"guided_regex": body["guided_regex"]}))
    final = streamed_completion(chunks).choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return calls


def test_auto_calls_come_from_the_models_own_format(auto_worker):
    """The demo model is made to write a hermes call (a regex holds it to the text): the call comes
    back as tool_calls, the words before it as content; streamed, the same call, its arguments in
    pieces."""
    body = {"model": "demo", "messages": CHAT, "tools": [WEATHER, CLOCK], "max_tokens": 240,
            "guided_regex": _regex("Sure. " + HERMES_CALL)}
    r = post(auto_worker, "chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and valid("weather", call["function"]["arguments"])
    client = openai.OpenAI(base_url=f"{auto_worker.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER], max_tokens=240,
                                                 stream=True, extra_body={"guided_regex": body["guided_regex"]}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas).strip() == "Sure."
    assert len([t for d in deltas for t in (d.tool_calls or [])]) > 2
    final = streamed_completion(chunks).choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
        ("weather", call["function"]["arguments"])]


def test_auto_without_a_call_is_a_plain_answer(auto_worker):
    body = {"model": "demo", "messages": CHAT, "tools": [WEATHER], "max_tokens": 20, "guided_regex": "no call, sorry"}
    choice = post(auto_worker, "chat/completions", body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call, sorry"} and choice["finish_reason"] == "stop"


# -- "auto" with --tool-call-parser llama3_json -----------------------------------------------------------

LLAMA3_CALLS = '{"name": "weather", "parameters": {"city": "Oslo", "unit": "F"}}; {"name": "clock", "parameters": {}}'


@pytest.fixture(scope="module")
def llama3_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "llama3_json")


def test_auto_calls_in_llama3_json(llama3_worker):
    """The demo model is made to write two llama3_json calls: both come back as tool_calls, content
    null; streamed, the calls alone; and a plain answer is content."""
    calls = auto_calls(llama3_worker, LLAMA3_CALLS)
    assert [c["function"]["name"] for c in calls] == ["weather", "clock"] and valid("weather", calls[0]["function"]["arguments"])
    plain = {"model": "demo", "messages": CHAT, "tools": [WEATHER, CLOCK], "max_tokens": 20, "guided_regex": "no call, sorry"}
    choice = post(llama3_worker, "chat/completions", plain).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call, sorry"} and choice["finish_reason"] == "stop"


# -- "auto" with --tool-call-parser mistral ----------------------------------------------------------------

MISTRAL_CALLS = '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}, {"name": "clock", "arguments": {"utc": true}}]'


@pytest.fixture(scope="module")
def mistral_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "mistral")


def test_auto_calls_in_mistral(mistral_worker):
    """The demo model is made to write Mistral's call list: both calls come back as tool_calls with
    Mistral's 9-character ids, content null; streamed, the same calls."""
    calls = auto_calls(mistral_worker, MISTRAL_CALLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo", "unit": "C"}), ("clock", {"utc": True})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


def test_mistral_answers_keep_special_tokens(mistral_worker):
    """`[TOOL_CALLS]` is a special token in Mistral's tokenizers, so under this parser an answer to a
    request with tools keeps special tokens in its text (the demo model is made to write one: content
    that is the token's text); without tools, they are left out as usual."""
    tok = mistral_worker.engine.tokenizer
    (special,) = tok.encode("<|user|>", add_special_tokens=False)
    body = {"model": "demo", "messages": CHAT, "max_tokens": 2, "temperature": 0, "logit_bias": {str(special): 100}}
    with_tools = post(mistral_worker, "chat/completions", {**body, "tools": [WEATHER]}).json()["choices"][0]
    assert with_tools["message"]["content"] == "<|user|><|user|>"
    plain = post(mistral_worker, "chat/completions", body).json()["choices"][0]
    assert plain["message"]["content"] == ""


# -- "auto" with --tool-call-parser pythonic ---------------------------------------------------------------

PYTHONIC_CALLS = "[weather(city='Paris', unit=\"F\"), clock(utc=True)]"


@pytest.fixture(scope="module")
def pythonic_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "pythonic")


def test_auto_calls_in_pythonic(pythonic_worker):
    """The demo model is made to write a Python list of calls: they come back as tool_calls with JSON
    arguments, content null; streamed, the same calls, an argument at a time."""
    calls = auto_calls(pythonic_worker, PYTHONIC_CALLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Paris", "unit": "F"}), ("clock", {"utc": True})]


def test_the_parser_flags_go_together():
    from lorafleet.worker.config import ConfigError
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        with pytest.raises(ConfigError):
            settings_from_args(build_parser().parse_args(["--model", "m", *flags]))
    args = build_parser().parse_args(["--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert settings_from_args(args).tool_call_parser == "hermes"

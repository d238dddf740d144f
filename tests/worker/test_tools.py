"""Function calling without a tool parser (worker/tools.py): a named tool_choice and "required" come
back as OpenAI's `tool_calls`, their arguments held to the tools' schemas (checked with `json`), from
the official client, streamed and not; what cannot be honoured is a 400 naming the field; tools and
earlier tool turns reach the chat template."""

from __future__ import annotations

import json

import openai
import pytest

from lorafleet.worker.tokenizer import Tokenizer
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
        if c.finish_reason == "length":  # the random demo model may write a long array: then it is text
            assert c.message.tool_calls is None and c.message.content.startswith("[")
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        assert all(valid(t.function.name, t.function.arguments) for t in c.message.tool_calls)


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


def test_a_streamed_call_arrives_whole_at_its_end(client):
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER], tool_choice=NAMED,
                                                 max_tokens=64, seed=1, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "weather"
    assert valid("weather", calls[0].function.arguments)
    assert not any(d.content for d in deltas) and chunks[-1].choices[0].finish_reason == "stop"


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
    from lorafleet.worker.openai_protocol import ChatCompletionRequest

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


def test_hermes_calls_are_parsed_out_of_the_text():
    from lorafleet.worker.tools import hermes_calls

    content, calls = hermes_calls("Let me check. " + HERMES_CALL + "\n<tool_call>\n{\"name\": \"clock\", \"arguments\": "
                                  "{\"utc\": true}}")  # the last one unterminated (EOS before its close)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["weather", "clock"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"utc": True}
    assert hermes_calls(HERMES_CALL)[0] is None
    for text in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>["weather"]</tool_call>'):
        assert hermes_calls(text) == (text, None)


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_hermes_stream_sends_the_content_then_the_calls(cut):
    from lorafleet.worker.tools import HermesStream

    text = "Sure <tool" + "> is a tag. " + HERMES_CALL
    stream = HermesStream()
    sent = "".join(stream.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    rest, calls = stream.finish()
    assert sent + rest == "Sure <tool> is a tag. " and calls[0]["function"]["name"] == "weather"
    plain = HermesStream()
    sent = "".join(plain.feed("a <tool_c"[i : i + cut]) for i in range(0, 9, cut))
    assert sent + plain.finish()[0] == "a <tool_c"  # held back while it could open a call, then sent


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


def test_auto_calls_come_from_the_models_own_format(auto_worker):
    """The demo model is made to write a hermes call (a regex holds it to the text): the call comes
    back as tool_calls, the words before it as content; streamed, the same pieces."""
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
    assert [t.function.name for d in deltas for t in (d.tool_calls or [])] == ["weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_a_plain_answer(auto_worker):
    body = {"model": "demo", "messages": CHAT, "tools": [WEATHER], "max_tokens": 20, "guided_regex": "no call, sorry"}
    choice = post(auto_worker, "chat/completions", body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call, sorry"} and choice["finish_reason"] == "stop"


# -- "auto" with --tool-call-parser llama3_json -----------------------------------------------------------

LLAMA3_CALLS = '{"name": "weather", "parameters": {"city": "Oslo", "unit": "F"}}; {"name": "clock", "parameters": {}}'


def test_llama3_calls_are_parsed_when_the_answer_is_calls():
    from lorafleet.worker.tools import llama3_calls

    content, calls = llama3_calls("  <|python_tag|>" + LLAMA3_CALLS + "\n")
    assert content is None and [c["function"]["name"] for c in calls] == ["weather", "clock"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "F"}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    (call,) = llama3_calls('{"name": "clock", "arguments": {"utc": true}}')[1]  # vLLM takes either key
    assert json.loads(call["function"]["arguments"]) == {"utc": True}
    for text in ("It is sunny. " + LLAMA3_CALLS, '{"name": "weather"} and more', '{"city": "Oslo"}',
                 '{"name": 3, "parameters": {}}', '{"name": "x", "parameters": [1]}', '{"name": "weather", "para',
                 "[1, 2]", ""):
        assert llama3_calls(text) == (text, None), text


@pytest.mark.parametrize("cut", [1, 4, 13])
def test_a_llama3_stream_holds_an_answer_that_opens_as_a_call(cut):
    from lorafleet.worker.tools import Llama3JsonStream

    def run(text: str):
        stream = Llama3JsonStream()
        sent = "".join(stream.feed(text[i : i + cut]) for i in range(0, len(text), cut))
        rest, calls = stream.finish()
        return sent, rest, calls

    sent, rest, calls = run(" \n<|python_tag|>" + LLAMA3_CALLS)
    assert sent == rest == "" and [c["function"]["name"] for c in calls] == ["weather", "clock"]
    sent, rest, calls = run("The weather is fine.")
    assert calls is None and sent + rest == "The weather is fine." and len(sent) >= len("The weather is fine.") - cut
    sent, rest, calls = run('{"name": "weather", "parameters": {"city": ')  # ran out of tokens: content after all
    assert sent == "" and rest == '{"name": "weather", "parameters": {"city": ' and calls is None
    assert run("<|pyth")[:2] == ("", "<|pyth")  # held while it could be the tag, then content


@pytest.fixture(scope="module")
def llama3_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "llama3_json")


def test_auto_calls_in_llama3_json(llama3_worker):
    """The demo model is made to write two llama3_json calls: both come back as tool_calls, content
    null; streamed, the calls alone; and a plain answer is content."""
    body = {"model": "demo", "messages": CHAT, "tools": [WEATHER, CLOCK], "max_tokens": 240,
            "guided_regex": _regex(LLAMA3_CALLS)}
    r = post(llama3_worker, "chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["weather", "clock"]
    assert valid("weather", choice["message"]["tool_calls"][0]["function"]["arguments"])
    client = openai.OpenAI(base_url=f"{llama3_worker.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, tools=[WEATHER, CLOCK], max_tokens=240,
                                                 stream=True, extra_body={"guided_regex": body["guided_regex"]}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    assert [t.function.name for d in deltas for t in (d.tool_calls or [])] == ["weather", "clock"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = {**body, "max_tokens": 20, "guided_regex": "no call, sorry"}
    choice = post(llama3_worker, "chat/completions", plain).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call, sorry"} and choice["finish_reason"] == "stop"


def test_the_parser_flags_go_together():
    from lorafleet.worker.cli import build_parser, settings_from_args
    from lorafleet.worker.config import ConfigError

    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        with pytest.raises(ConfigError):
            settings_from_args(build_parser().parse_args(["--model", "m", *flags]))
    args = build_parser().parse_args(["--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert settings_from_args(args).tool_call_parser == "hermes"

"""`POST /v1/responses` served (worker/server/responses_route.py), through the official `openai` client:
the oracle is the same greedy request through `/v1/chat/completions` (its content is the
output_text, its tool_calls the function_call items, its reasoning the reasoning item, its usage
the usage); streamed, the client's own stream reader puts together the same response, and every
event validates as the library's `ResponseStreamEvent`; what this stateless worker cannot do, or
what is spelled as chat spells it, is a 400 naming the Responses field."""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.worker.test_api_openai_compat import post, refused
from tests.worker.test_reasoning import make_thinking_model, reasoning_worker
from tests.worker.worker_harness import CHAT

QUESTION = CHAT[0]["content"]
# The library's event classes by their `type` (validating against the right one reads better than the union).
_EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
           for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def client_of(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(worker, **body) -> dict:
    r = post(worker, "chat/completions", {"model": "demo", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse(worker, body: dict) -> list[dict]:
    """The raw stream's events: each `event:` line names its data's type, the sequence numbers run
    0, 1, 2, ..., each validates as the library's event type; no `[DONE]`."""
    with httpx.stream("POST", f"{worker.url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names, data = lines[0::2], lines[1::2]
    assert len(names) == len(data) and all(n.startswith("event: ") and d.startswith("data: ") for n, d in zip(names, data))
    events = [json.loads(d.removeprefix("data: ")) for d in data]
    assert [n.removeprefix("event: ") for n in names] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        _EVENTS[e["type"]].model_validate(e)
    return events


def same_answer(a: Response, b: Response) -> None:
    """Two responses to one greedy request agree, ids and times apart."""
    def shape(r: Response) -> list:  # (`parsed...`: the stream reader's own additions)
        items = [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id", "parsed_arguments")}
                 for item in r.output]
        for item in items:
            for part in item.get("content") or ():
                part.pop("parsed", None)
        return items

    assert (a.status, a.incomplete_details, a.usage) == (b.status, b.incomplete_details, b.usage)
    assert shape(a) == shape(b)


def streamed(worker, **body) -> Response:
    """The response the client's stream reader builds (its final one when completed; the last
    event's, which the reader fills with the items it put together, when incomplete), checked
    against the raw stream's last event."""
    with client_of(worker).responses.stream(**body) as stream:
        last_event = list(stream)[-1]
        final = stream.get_final_response() if last_event.type == "response.completed" else last_event.response
    last = sse(worker, {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})})[-1]
    same_answer(final, Response.model_validate(last["response"]))
    return final


# -- plain text ---------------------------------------------------------------------------------------------

def test_the_answer_is_chats_answer(worker):
    """A string input is one user turn: the output_text, the usage and the finish are chat's for
    the same greedy request; the response reports the request's settings; streamed, the same."""
    want = chat(worker, messages=CHAT, max_tokens=12)
    r = client_of(worker).responses.create(model="demo", input=QUESTION, max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "demo"
    assert r.output_text == want["choices"][0]["message"]["content"]
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    use = want["usage"]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        use["prompt_tokens"], use["completion_tokens"], use["total_tokens"])
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    finish = want["choices"][0]["finish_reason"]
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert (r.max_output_tokens, r.temperature, r.store, r.tool_choice, r.text.format.type) == (12, 0, False, "auto", "text")
    same_answer(streamed(worker, model="demo", input=QUESTION, max_output_tokens=12, temperature=0), r)


def test_max_output_tokens_reached_is_incomplete(worker):
    r = client_of(worker).responses.create(model="demo", input=QUESTION, max_output_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = sse(worker, {"model": "demo", "input": QUESTION, "max_output_tokens": 3, "temperature": 0,
                          "ignore_eos": True})
    assert events[-1]["type"] == "response.incomplete"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == r.output_text


def test_non_finite_logits_make_the_response_failed(worker):
    """The engine ends a request whose logits are not finite (here from its third token on): the
    response is failed with OpenAI's server_error, the message cut short holds the text so far
    (chat's two tokens, finish "error"); streamed, the same text in deltas, then response.failed."""
    def poison(seqs, logits):
        for row, seq in enumerate(seqs):
            if len(seq.output_ids) >= 2:
                logits[row].fill_(float("nan"))

    body = dict(model="demo", input=QUESTION, max_output_tokens=8, temperature=0)
    worker.engine.logits_hook = poison
    try:
        want = chat(worker, messages=CHAT, max_tokens=8)["choices"][0]
        r = client_of(worker).responses.create(**body)
        events = sse(worker, body)
    finally:
        worker.engine.logits_hook = None
    assert want["finish_reason"] == "error" and want["message"]["content"]
    assert r.status == "failed" and r.error.code == "server_error" and r.output_text == want["message"]["content"]
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == r.output_text
    same_answer(Response.model_validate(events[-1]["response"]), r)


def test_an_engine_failure_mid_stream_is_an_error_event(worker):
    """The engine step raising once the answer has begun (a bug, not bad input): the stream, its
    head sent, ends in OpenAI's `error` event (a 500, the exception's type and nothing of its
    text), as chat's ends in its error object then [DONE]; the worker serves the next request."""
    def explode(seqs, logits):
        if any(len(seq.output_ids) >= 2 for seq in seqs):
            raise RuntimeError("secret internals")

    body = dict(model="demo", input=QUESTION, max_output_tokens=8, temperature=0)
    worker.engine.logits_hook = explode
    try:
        events = sse(worker, body)
        with httpx.stream("POST", f"{worker.url}/v1/chat/completions", timeout=60, json={
                "model": "demo", "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            chunks = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln]
    finally:
        worker.engine.logits_hook = None
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1] == {"type": "error", "code": "500", "message": "internal error: EngineFailure", "param": None,
                          "sequence_number": len(events) - 1}
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")  # the text so far
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2]) == {"error": {
        "message": "internal error: EngineFailure", "type": "InternalServerError", "param": None, "code": 500}}
    r = client_of(worker).responses.create(**body)
    assert r.error is None and r.usage.output_tokens == 8 and r.output_text  # max_output_tokens reached


def test_instructions_and_turns_are_the_chat_messages(worker):
    """`instructions` is a system message first; message items with text parts, earlier assistant
    output_text among them, are the turns: the same prompt (input_tokens) and answer as chat's."""
    turns = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": QUESTION}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTION}]
    want = chat(worker, messages=messages, max_tokens=10)
    r = client_of(worker).responses.create(model="demo", instructions="Be brief.", input=turns,
                                           max_output_tokens=10, temperature=0)
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"] and r.instructions == "Be brief."


def test_an_adapter_is_named_as_the_model(worker):
    want = chat(worker, model="sql", messages=CHAT, max_tokens=10)
    r = client_of(worker).responses.create(model="sql", input=QUESTION, max_output_tokens=10, temperature=0)
    assert r.output_text == want["choices"][0]["message"]["content"] and r.model == "sql"
    base = client_of(worker).responses.create(model="demo", input=QUESTION, max_output_tokens=10, temperature=0)
    assert base.output_text != r.output_text  # the adapter changed the answer: it was used


def test_logprobs_are_chats_with_include(worker):
    """include message.output_text.logprobs with top_logprobs: the output_text's logprobs are chat's
    logprobs.content for the same request, token for token; streamed, the deltas carry them all."""
    want = chat(worker, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    body = dict(model="demo", input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    r = client_of(worker).responses.create(**body)
    got = [lp.model_dump() for lp in r.output[0].content[0].logprobs]
    assert got == want
    events = sse(worker, body)
    assert [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]] == want
    plain = client_of(worker).responses.create(model="demo", input=QUESTION, max_output_tokens=6, temperature=0)
    assert plain.output[0].content[0].logprobs is None


def test_text_format_json_schema_holds_the_answer(worker):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    want = chat(worker, messages=CHAT, max_tokens=30,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    r = client_of(worker).responses.create(model="demo", input=QUESTION, max_output_tokens=30, temperature=0,
                                           text={"format": fmt})
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert json.loads(r.output_text)["city"] in ("Paris", "Oslo") and r.text.format.type == "json_schema"


# -- tool calls ---------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "weather", "description": "today's weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def auto_worker(demo_model, demo_adapters):
    pytest.importorskip("xgrammar")
    from tests.worker.test_tools import parsing_worker

    yield from parsing_worker(demo_model, demo_adapters, "hermes")


def test_calls_are_function_call_items(auto_worker):
    """The demo model made to write words and a hermes call: a message with the words, then a
    function_call item with chat's name and arguments; streamed, the same items, the arguments in
    pieces."""
    from tests.worker.test_tools import HERMES_CALL, _regex

    regex = _regex("Sure. " + HERMES_CALL)
    want = chat(auto_worker, messages=CHAT, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=240, guided_regex=regex)["choices"][0]["message"]
    body = dict(model="demo", input=QUESTION, tools=[WEATHER], max_output_tokens=240, temperature=0,
                extra_body={"guided_regex": regex})
    r = client_of(auto_worker).responses.create(**body)
    message, call = r.output
    assert message.type == "message" and message.content[0].text == want["content"] == "Sure."
    (chat_call,) = want["tool_calls"]
    assert call.type == "function_call" and (call.name, call.arguments) == (
        chat_call["function"]["name"], chat_call["function"]["arguments"])
    assert call.call_id and call.id.startswith("fc_") and r.status == "completed"
    events = sse(auto_worker, {**{k: v for k, v in body.items() if k != "extra_body"}, "guided_regex": regex})
    assert len([e for e in events if e["type"] == "response.function_call_arguments.delta"]) > 2
    same_answer(streamed(auto_worker, **body), r)


def test_a_messages_logprobs_before_a_call_are_the_streams(auto_worker):
    """include logprobs, words then a hermes call: the whole response's message has the logprobs
    the stream's has (those of the tokens until the call began, not all the answer's), and chat's
    first ones."""
    from tests.worker.test_tools import HERMES_CALL, _regex

    regex = _regex("Sure. " + HERMES_CALL)
    body = dict(model="demo", input=QUESTION, tools=[WEATHER], max_output_tokens=240, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2, guided_regex=regex)
    whole = post(auto_worker, "responses", body).json()
    last = sse(auto_worker, body)[-1]["response"]
    (message, call), (streamed_message, _) = whole["output"], last["output"]
    lps = message["content"][0]["logprobs"]
    want = chat(auto_worker, messages=CHAT, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=240, guided_regex=regex, logprobs=True,
        top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert call["type"] == "function_call" and 0 < len(lps) < whole["usage"]["output_tokens"]
    for other in (streamed_message["content"][0]["logprobs"], want[:len(lps)]):  # (a prefix-cache hit
        assert [e["token"] for e in other] == [e["token"] for e in lps]           # moves the last digits)
        assert [e["logprob"] for e in other] == pytest.approx([e["logprob"] for e in lps], abs=1e-4)


def test_earlier_calls_and_their_outputs_reach_the_template(auto_worker):
    """function_call and function_call_output items are the assistant's tool_calls and the tool's
    message: the prompt (input_tokens) and the answer are chat's for those messages."""
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    want = chat(auto_worker, messages=messages, tools=tools, tool_choice="none", max_tokens=8)
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": "call_1", "output": "4 degrees"}]
    r = client_of(auto_worker).responses.create(model="demo", input=items, tools=[WEATHER], tool_choice="none",
                                                max_output_tokens=8, temperature=0)
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.output_text == want["choices"][0]["message"]["content"]
    without = chat(auto_worker, messages=CHAT, tools=tools, tool_choice="none", max_tokens=8)
    assert without["usage"]["prompt_tokens"] < r.usage.input_tokens  # the turns were in the prompt


# -- reasoning ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def r1_worker(demo_model, demo_adapters, tmp_path_factory):
    model = make_thinking_model(demo_model, tmp_path_factory.mktemp("thinking") / "model")
    yield from reasoning_worker(model, demo_adapters, "deepseek_r1", "hermes")


def test_reasoning_is_its_own_item(r1_worker):
    """deepseek_r1: answers begin in their reasoning; the demo model, pushed to one token, never
    writes `</think>`: a reasoning item with chat's reasoning and no message (chat's content is
    null), every token a reasoning token; streamed, the same, the text in reasoning_text deltas."""
    from tests.worker.test_reasoning import token

    bias = {str(token(r1_worker, "The")): 100}
    want = chat(r1_worker, messages=CHAT, max_tokens=4, logit_bias=bias)["choices"][0]["message"]
    body = dict(model="demo", input=QUESTION, max_output_tokens=4, temperature=0, extra_body={"logit_bias": bias})
    r = client_of(r1_worker).responses.create(**body)
    (reasoning,) = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and want["content"] is None
    assert reasoning.content[0].text == want["reasoning"] == "The" * 4 and reasoning.status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 4 and r.output_text == ""
    events = sse(r1_worker, {"model": "demo", "input": QUESTION, "max_output_tokens": 4, "temperature": 0,
                             "logit_bias": bias})
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "The" * 4
    same_answer(streamed(r1_worker, **body), r)


def test_the_answer_after_the_reasoning_is_the_message(r1_worker):
    """The model made to end its reasoning at once (`</think>` first), then a guided choice: no
    reasoning item (chat's reasoning is null), the message chat's content; the `</think>` token is
    the one reasoning token."""
    from tests.worker.test_reasoning import token

    extra = {"logit_bias": {str(token(r1_worker, "</think>")): 100}, "guided_choice": ["Paris", "Oslo"]}
    want = chat(r1_worker, messages=CHAT, max_tokens=16, **extra)["choices"][0]["message"]
    r = client_of(r1_worker).responses.create(model="demo", input=QUESTION, max_output_tokens=16, temperature=0,
                                              extra_body=extra)
    (message,) = r.output
    assert want["reasoning"] is None and message.type == "message" and r.output_text == want["content"]
    assert r.usage.output_tokens_details.reasoning_tokens == 1 and r.status == "completed"


# -- refused ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,param,says", [
    ({"messages": CHAT}, "messages", "use input"),
    ({"max_tokens": 5}, "max_tokens", "max_output_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"n": 2}, "n", "one answer"),
    ({"background": True}, "background", "stored"),
    ({"conversation": "conv_1"}, "conversation", "stored"),
    ({"truncation": "auto"}, "truncation", "auto"),
    ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ({"top_logprobs": 3}, "top_logprobs", "include"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "web_search"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0", "input_image"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id", "call_id"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
    ({"seed": "one"}, "seed", "seed"),
    ({"max_output_tokens": 100000}, None, "max_output_tokens (100000) exceeds"),
    ({"input": [{"type": ["message"]}]}, "input.0", "not supported"),  # an unhashable type was a 500
    ({"input": [{"type": {"a": 1}}]}, "input.0", "not supported"),
    ({"input": [5]}, "input", "input"),  # pydantic's union members are not in param ("input.str")
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input.0.content", "content"),
])
def test_what_cannot_be_done_is_a_400_naming_the_field(worker, extra, param, says):
    body = {"model": "demo", "input": QUESTION, "max_output_tokens": 4, **extra}
    message = refused(post(worker, "responses", body), param)
    assert says in message, message


def test_bad_values_are_400s(worker):
    r = post(worker, "responses", {"model": "demo", "input": QUESTION, "max_output_tokens": 0})
    assert r.status_code == 400 and "max_output_tokens" in r.text
    r = post(worker, "responses", {"model": "demo"})
    assert r.status_code == 400 and "input" in r.text
    r = post(worker, "responses", {"model": "nope", "input": QUESTION})
    assert r.status_code == 404 and "nope" in r.text


def test_a_previous_response_is_not_kept(worker):
    r = post(worker, "responses", {"model": "demo", "input": QUESTION, "previous_response_id": "resp_1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert "resp_1" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client_of(worker).responses.create(model="demo", input=QUESTION, previous_response_id="resp_1")

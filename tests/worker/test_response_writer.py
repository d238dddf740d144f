"""The Responses API answer builder (worker/openai/response_writer.py), torch-free: answers of reasoning,
words and calls, read by the chat reader (worker/openai/chat_answer.py `AnswerStream`) and fed whole or
cut into pieces of every size, give the same response (its items those chat's whole answer gives,
`chat_answer.answer` the oracle); every event and the response validate as the `openai` library's
types; the deltas add up to the items' texts."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from lorafleet.worker.openai.chat_answer import OFF, AnswerStream, answer
from lorafleet.worker.openai.response_writer import ResponseWriter
from lorafleet.worker.openai.tools import ToolPlan

_EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
           for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
BASE = {"id": "resp_1", "created_at": 0, "model": "demo", "instructions": None, "max_output_tokens": None,
        "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
        "text": {"format": {"type": "text"}}, "store": False, "metadata": {}}
USAGE = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
HERMES = ToolPlan(None, None, "hermes")
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
CLOCK = '<tool_call>{"name": "clock", "arguments": {}}</tool_call>'


def run(start, tool, pieces: list[str], reason: str = "stop", logprobs: list[list[dict]] | None = None):
    """(the events, the final response) for an answer arriving in `pieces`."""
    writer, reader = ResponseWriter(dict(BASE), logprobs is not None), AnswerStream(start, tool)
    events = writer.start()
    for i, piece in enumerate(pieces):
        events += writer.feed(*reader.feed(piece, i == len(pieces) - 1), logprobs[i] if logprobs else None)
    events += writer.finish(reason, USAGE)
    for e in events:
        _EVENTS[e["type"]].model_validate(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, Response.model_validate(writer.response())


def shape(r: Response) -> list[dict]:
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in r.output]


def cuts(text: str) -> list[list[str]]:
    return [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 7, len(text))]


ANSWERS = [
    (OFF, None, "Paris is the capital."),
    (OFF, None, "  \n"),  # whitespace only: its own text
    (OFF, None, "Paris.\n\n"),  # trailing whitespace kept without a call
    (OFF, HERMES, "Sure. " + CALL),
    (OFF, HERMES, CALL + CLOCK),
    (OFF, HERMES, " \n" + CALL),  # whitespace before a call: dropped, as chat drops it
    (True, None, "let me see</think>Paris"),
    (True, None, "never closed"),
    (True, HERMES, "hmm</think>\n\n" + CALL),
    (None, None, "<think>x</think>y"),  # qwen3: the answer opens its reasoning
]


@pytest.mark.parametrize("start,tool,text", ANSWERS)
def test_every_cut_gives_chats_answer(start, tool, text):
    fields, content, calls, _ = answer(start, tool, text, "stop")
    _, whole = run(start, tool, [text])
    kinds = [i.type for i in whole.output]
    want_kinds = (["reasoning"] if fields.get("reasoning") else []) + (["message"] if content is not None else []) + (
        ["function_call"] * len(calls or ()))
    assert kinds == want_kinds, (kinds, fields, content, calls)
    if fields.get("reasoning"):
        assert whole.output[0].content[0].text == fields["reasoning"]
    if content is not None:
        assert whole.output_text == content
    got_calls = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert got_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls or ()]
    assert whole.status == "completed" and whole.usage.total_tokens == 8
    for pieces in cuts(text):
        events, r = run(start, tool, pieces)
        assert shape(r) == shape(whole), pieces
        assert [e["type"] for e in events][-1] == "response.completed"
        for item in r.output:  # the deltas add up to each item's text
            deltas = "".join(e.get("delta", "") for e in events if e.get("item_id") == item.id)
            assert deltas == (item.arguments if item.type == "function_call" else item.content[0].text)


def test_the_event_order_of_an_answer_with_everything():
    events, r = run(True, HERMES, ["hmm</think>", "Sure. ", *(CALL[i : i + 5] for i in range(0, len(CALL), 5))])
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1 and kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",  # the call begins
        "response.output_item.added", *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert json.loads(r.output[2].arguments) == {"city": "Oslo"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_length_makes_the_response_and_open_items_incomplete():
    events, r = run(OFF, None, ["Paris is"], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"


def test_an_engine_error_makes_the_response_failed():
    events, r = run(OFF, None, ["Paris"], reason="error")
    assert events[-1]["type"] == "response.failed" and r.status == "failed"
    assert r.error.code == "server_error" and "not finite" in r.error.message and r.output[0].status == "incomplete"


def test_an_empty_answer_is_an_empty_message():
    _, r = run(OFF, None, [""])
    assert shape(r) == [{"type": "message", "role": "assistant", "status": "completed",
                         "content": [{"type": "output_text", "text": "", "annotations": []}]}]


def lp(token: str) -> dict:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}


def test_logprobs_go_with_the_text_they_made():
    """Each text delta carries the tokens since the last one (held whitespace's with the text after
    it); the message's part has them all."""
    events, r = run(OFF, None, ["Paris", " ", "is", ""], logprobs=[[lp("Paris")], [lp(" ")], [lp("is")], [lp("")]])
    deltas = [(e["delta"], [x["token"] for x in e["logprobs"]]) for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [("Paris", ["Paris"]), (" is", [" ", "is"])]
    assert [x.token for x in r.output[0].content[0].logprobs] == ["Paris", " ", "is", ""]
    _, plain = run(OFF, None, ["Paris"])
    assert plain.output[0].content[0].logprobs is None

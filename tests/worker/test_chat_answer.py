"""`AnswerStream` against `answer`: a chat answer read as it streams, cut into pieces anywhere,
gives the whole answer's reasoning, content, calls and finish_reason, for every reasoning start,
tool plan and call format (the whole answer is the oracle the stream must reproduce)."""

from __future__ import annotations

import random

import pytest

from lorafleet.worker.openai.chat_answer import OFF, AnswerStream, answer
from lorafleet.worker.openai.tools import PARSERS, plan

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
             "type": "object", "properties": {"a": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "put", "parameters": {"type": "object"}}}]
PLANS = {"none": None, **{p: plan(TOOLS, "auto", True, p) for p in PARSERS},
         "required": plan(TOOLS, "required"), "forced": plan(TOOLS, {"type": "function", "function": {"name": "get"}})}
PLAIN = ["hello world", "  spaced  ", "", " \n"]
ANSWERS = {
    "none": [],
    "hermes": ['Sure. <tool_call>{"name": "get", "arguments": {"a": "x"}}</tool_call>',
               '<tool_call>{"name": "get", "arguments": {"a": "x"}}</tool_call>\n<tool_call>{"name": "put", "arguments": {}}</tool_call>',
               ' \n<tool_call>{"name": "get", "arguments": {"a": "x<"}}</tool_call> trailing',
               'text  <tool_call>{"name": "get", "argu', "<tool_call>not json</tool_call>", "x <tool_call"],
    "llama3_json": ['{"name": "get", "parameters": {"a": "x"}}',
                    '<|python_tag|>{"name": "get", "parameters": {"a": "x"}}; {"name": "put", "parameters": {}}',
                    '{"name": "get", "param', "not a call"],
    "mistral": ['[TOOL_CALLS][{"name": "get", "arguments": {"a": "x"}}]', 'hi \n[TOOL_CALLS]get[ARGS]{"a": "x"}',
                '[TOOL_CALLS][{"name": "get", "argu', "text only"],
    "pythonic": ['[get(a="x")]', '[get(a="x"), put()]', '[get(a="x"', "plain"],
    "required": ['[{"name": "get", "parameters": {"a": "x"}}]', '[{"name": "get", "param'],
    "forced": ['{"a": "x"}', '{"a": "x', "{}"],
}
THINKING = ["", "<think>thinking hard</think>", "<think>a</think>\n\n", "thinking</think>", "<think>never closed",
            "</think>"]


def streamed(start, tool, text: str, cuts: list[int], reason: str) -> tuple:
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream, thought, content, calls = AnswerStream(start, tool), "", "", {}
    for i, piece in enumerate(pieces):
        t, c, entries = stream.feed(piece, i == len(pieces) - 1)
        thought, content = thought + t, content + c
        for e in entries:
            call = calls.setdefault(e["index"], ["", ""])
            fn = e.get("function", {})
            call[0] += fn.get("name") or ""
            call[1] += fn.get("arguments") or ""
    return thought, content, [tuple(c) for _, c in sorted(calls.items())], stream.finish_reason(reason)


@pytest.mark.parametrize("name", list(PLANS))
def test_the_stream_reads_as_the_whole_answer(name):
    rng = random.Random(name)
    tool = PLANS[name]
    for body in ANSWERS[name] + PLAIN:
        for start in (OFF, True, False, None):
            for lead in [""] if start is OFF else THINKING:
                text = lead + body
                for reason in ("stop", "length"):
                    fields, content, calls, why = answer(start, tool, text, reason)
                    want = (fields.get("reasoning") or "", content or "",
                            [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []], why)
                    for trial in range(6):  # a piece per character first, then random cuts
                        cuts = (list(range(1, len(text))) if trial == 0 else
                                sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5))))
                                if len(text) > 1 else [])
                        assert streamed(start, tool, text, cuts, reason) == want, (start, text, cuts, reason)

"""A chat choice's answer read into the message's parts: its reasoning, when the worker has a
--reasoning-parser (worker/reasoning.py), then its content and, under a tool plan, its tool calls
(worker/tools.py), which are read out of the content alone. Streamed (`AnswerStream`) and whole
(`answer`) go through the same readers."""

from __future__ import annotations

from typing import Any

from lorafleet.worker import reasoning as reasoning_
from lorafleet.worker import tools
from lorafleet.worker.tools import ToolPlan

OFF = object()  # no reasoning parser: the whole answer is content (the message has no reasoning field)


class AnswerStream:
    """`feed(delta, finished)` returns the step's (reasoning, content, tool_calls entries) pieces."""

    def __init__(self, start: bool | None | object, tool: ToolPlan | None) -> None:
        self.reasoning = None if start is OFF else reasoning_.ReasoningStream(start)  # type: ignore[arg-type]
        self.tool = tool
        self.calls = tools.stream(tool) if tool is not None else None

    def feed(self, delta: str, finished: bool) -> tuple[str, str, list[dict[str, Any]]]:
        thought, content = ("", delta) if self.reasoning is None else self.reasoning.feed(delta)
        if finished and self.reasoning is not None:
            more = self.reasoning.finish()
            thought, content = thought + more[0], content + more[1]
        if self.calls is None:
            return thought, content, []
        content, entries = self.calls.feed(content)
        if finished:
            rest, more_entries = self.calls.finish()
            content, entries = content + rest, entries + more_entries
        return thought, content, entries

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self.calls is None else tools.finish_reason(self.tool, self.calls.calls, reason)


def answer(start: bool | None | object, tool: ToolPlan | None, text: str, reason: str | None
           ) -> tuple[dict[str, Any], str | None, list[dict[str, Any]] | None, str | None]:
    """A finished answer as (the message's reasoning fields, content, tool calls, finish_reason):
    no reasoning fields without a parser; with one, `reasoning` (vLLM's name) and
    `reasoning_content` (its earlier one) alike, and content null when the answer was all reasoning."""
    if start is OFF:
        return {}, *tools.answer(tool, text, reason)
    thought, content = reasoning_.split(start, text)  # type: ignore[arg-type]
    fields = {"reasoning": thought, "reasoning_content": thought}
    if content is None:
        return fields, None, None, reason
    return fields, *tools.answer(tool, content, reason)

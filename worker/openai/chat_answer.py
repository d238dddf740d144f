"""A chat choice's answer read into the message's parts: its reasoning, when the worker has a
--reasoning-parser (worker/openai/reasoning.py), then its content and, under a tool plan, its tool calls
(worker/openai/tools.py), which are read out of the content alone. Streamed (`AnswerStream`) and whole
(`answer`) go through the same readers."""

from __future__ import annotations

from typing import Any

from lorafleet.worker.openai import reasoning as reasoning_
from lorafleet.worker.openai import tools
from lorafleet.worker.openai.tools import ToolPlan

_WS = " \t\r\n"
OFF = object()  # no reasoning parser: the whole answer is content (the message has no reasoning field)


class AnswerStream:
    """`feed(delta, finished)` returns the step's (reasoning, content, tool_calls entries) pieces."""

    def __init__(self, start: bool | None | object, tool: ToolPlan | None) -> None:
        self.reasoning = None if start is OFF else reasoning_.ReasoningStream(start)  # type: ignore[arg-type]
        self.tool = tool
        self.calls = tools.stream(tool) if tool is not None else None
        # Calls are read out of the content alone: with a parser, only once the content begins (a
        # forced call's reader opens its call at once; an answer that never leaves its reasoning has none).
        self._content_began = self.reasoning is None
        self._held = ""  # the content's trailing whitespace, until text follows (`_hold_spaces`)

    def feed(self, delta: str, finished: bool) -> tuple[str, str, list[dict[str, Any]]]:
        thought, content = ("", delta) if self.reasoning is None else self.reasoning.feed(delta)
        if finished and self.reasoning is not None:
            more = self.reasoning.finish()
            thought, content = thought + more[0], content + more[1]
        self._content_began = self._content_began or bool(content)
        if self.calls is None or not self._content_began:
            return thought, content, []
        content, entries = self.calls.feed(content)
        if finished:
            rest, more_entries = self.calls.finish()
            content, entries = content + rest, entries + more_entries
        return thought, self._hold_spaces(content, bool(entries), finished), entries

    def _hold_spaces(self, content: str, called: bool, finished: bool) -> str:
        """The content's trailing whitespace is held until text follows: dropped if a call comes
        next, as the whole answer drops it (`tools.answer`), sent at the end if none does."""
        text = self._held + content
        if called or self.calls.calls:
            self._held = ""
            return text.rstrip(_WS) if called else text
        if finished:
            self._held = ""
            return text
        kept = text.rstrip(_WS)
        self._held = text[len(kept):]
        return kept

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

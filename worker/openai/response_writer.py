"""One Responses API answer (worker/openai/responses_protocol.py) built from its pieces as they arrive:
the step's reasoning, content and tool-call entries (worker/openai/chat_answer.py `AnswerStream`) become
output items (a `reasoning` item, a `message` with one `output_text`, a `function_call` per call)
and the stream's semantic events (`response.output_text.delta`, ...). A whole answer is the same
writer fed the same steps (not streamed), so the streamed and the whole response agree by
construction, the message's logprobs included. Torch-free.

Output order is the answer's: reasoning, then the message, then the calls, one item open at a
time. The content's trailing whitespace is held until text follows: before a call it is dropped, as
chat drops it. The message's `logprobs` are those of the tokens generated until it ends: without
a call, every token's, as chat's `logprobs.content` (its reasoning's too); with calls after it, not
theirs. Streamed, each text delta carries the tokens since the one before.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\r\n"
FAILED = "generation stopped: the model's logits for this request were not finite"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # output_index
    id: str
    text: str = ""  # the reasoning's or the message's text; a call's arguments
    name: str = ""
    call_id: str = ""
    status: str = "in_progress"
    logprobs: list[dict] | None = None  # a message's, when it ends (include asked for them)

    def as_json(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if self.status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        if self.kind == "message":
            content = [_text_part(self.text, self.logprobs)] if self.status != "in_progress" else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": content}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": self.status}


def _text_part(text: str, logprobs: list[dict] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


@dataclass(slots=True)
class ResponseWriter:
    """`start()`, then `feed(...)` per step, then `finish(...)`: each returns the stream's events;
    `response()` is the response object as it stands."""

    base: dict[str, Any]  # id, created_at, model and the request's echoed settings
    logprobs: bool = False  # include: ["message.output_text.logprobs"]
    items: list[_Item] = field(default_factory=list)
    status: str = "in_progress"
    usage: dict[str, Any] | None = None
    _seq: int = 0
    _held: str = ""  # the content's trailing whitespace, not sent yet
    _lps: list[dict] = field(default_factory=list)  # every token's, for the message
    _unsent_lps: list[dict] = field(default_factory=list)  # since the last text delta
    _calls: dict[int, _Item] = field(default_factory=dict)  # by the tool_calls entry's index

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, thought: str, content: str, entries: list[dict[str, Any]],
             logprobs: list[dict] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if logprobs:
            self._lps += logprobs
            self._unsent_lps += logprobs
        if thought:
            item = self._open("reasoning", events)
            item.text += thought
            events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=thought))
        if content:
            self._content(content, events)
        for entry in entries:
            self._call(entry, events)
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """Closes what is open: "length" (max_output_tokens reached) makes the response, and the
        items cut short, incomplete; "error" (the engine ended the request: its logits were not
        finite) makes it failed, with OpenAI's `server_error`."""
        events: list[dict[str, Any]] = []
        if not self._calls and (self._held or not self.items):
            self._content("", events, hold=False)  # the held whitespace is the text's; an empty answer a message
        self.status = {"length": "incomplete", "error": "failed"}.get(finish_reason or "", "completed")
        for item in self.items:
            if item.status == "in_progress":
                self._close(item, events, "completed" if self.status == "completed" else "incomplete")
        self.usage = usage
        events.append(self._event(f"response.{self.status}", response=self.response()))
        return events

    @property
    def has_reasoning(self) -> bool:
        return any(i.kind == "reasoning" for i in self.items)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event of this response's stream, numbered in its sequence (the route's `error`)."""
        return self._event(kind, **fields)

    def response(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        error = {"code": "server_error", "message": FAILED} if self.status == "failed" else None
        return {
            **self.base, "object": "response", "status": self.status, "error": error,
            "incomplete_details": incomplete,
            "output": [i.as_json() for i in self.items] if done else [],
            "usage": self.usage,
        }

    # ---- items -------------------------------------------------------------------------------

    def _content(self, content: str, events: list[dict[str, Any]], hold: bool = True) -> None:
        text = self._held + content
        content = text.rstrip(_WS) if hold else text
        self._held = text[len(content):]
        message = next((i for i in self.items if i.kind == "message"), None)
        if message is None:
            if hold and not content:
                return
            message = self._open("message", events)
        message.text += content
        if content:
            lps, self._unsent_lps = self._unsent_lps, []
            events.append(self._event("response.output_text.delta", item_id=message.id, output_index=message.index,
                                      content_index=0, delta=content, logprobs=lps if self.logprobs else []))

    def _call(self, entry: dict[str, Any], events: list[dict[str, Any]]) -> None:
        fn = entry.get("function", {})
        item = self._calls.get(entry["index"])
        if item is None:  # the call's first entry names it
            self._held = ""  # (no content follows a call: the call reader drops it, as chat does)
            for other in self.items:
                if other.status == "in_progress":
                    self._close(other, events, "completed")
            item = self._calls[entry["index"]] = self._open("function_call", events, name=fn.get("name") or "",
                                                            call_id=entry.get("id") or new_id("call"))
        piece = fn.get("arguments") or ""
        if piece:
            item.text += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.index, delta=piece))

    def _open(self, kind: str, events: list[dict[str, Any]], **fields: str) -> _Item:
        last = self.items[-1] if self.items else None
        if last is not None and last.kind == kind and last.status == "in_progress" and kind != "function_call":
            return last
        if last is not None and last.kind == "reasoning" and last.status == "in_progress":
            self._close(last, events, "completed")  # the answer has left its reasoning
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, len(self.items), new_id(prefix), **fields)
        self.items.append(item)
        events.append(self._event("response.output_item.added", output_index=item.index, item=item.as_json()))
        if kind == "reasoning":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        elif kind == "message":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part=_text_part("", [] if self.logprobs else None)))
        return item

    def _close(self, item: _Item, events: list[dict[str, Any]], status: str) -> None:
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=item.text))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        elif item.kind == "message":
            item.logprobs = lps = list(self._lps) if self.logprobs else None
            events.append(self._event("response.output_text.done", **where, content_index=0, text=item.text,
                                      logprobs=lps or []))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=_text_part(item.text, lps)))
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item.name,
                                      arguments=item.text))
        events.append(self._event("response.output_item.done", output_index=item.index,
                                  item=item.as_json()))

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

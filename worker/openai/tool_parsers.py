"""Tool calls read out of an answer as it is written, so that a streamed call's arguments go out
piece by piece, as OpenAI streams them, and a whole answer is read by the same code (`parse`), so
streamed and not give the same calls.

A `CallStream` is fed the answer's text deltas and returns, for each, the content to send and the
`tool_calls` delta entries (OpenAI's: a call's first entry holds its `index`, `id`, `type` and
`function.name` with empty `arguments`, the next ones `function.arguments` pieces). The formats
(`FORMATS`):

- `forced` (a named `tool_choice`): the whole answer is the call's arguments.
- `required`: the answer is a JSON array of `{"name": ..., "parameters": {...}}` objects.
- `hermes`: calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after any
  text (Qwen 2.5/3, Hermes); the text before the first call is content, text between and after
  calls is dropped.
- `llama3_json`: an answer that is one or more `{"name": ..., "parameters": {...}}` objects
  separated by `;`, after an optional `<|python_tag|>` (Llama 3.1-3.3).
- `mistral`: after any text, `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`
  objects (Mistral 7B v0.3, Nemo), or `[TOOL_CALLS]name[ARGS]{...}` a call (the newer tokenizers'
  form); `[TOOL_CALLS]` is a special token, so these requests keep special tokens in their text.
- `pythonic`: an answer that is a Python list of calls, `[name(key=literal, ...), ...]` (Llama 3.2,
  Llama 4; worker/openai/pythonic_call.py reads a call). Its arguments are Python, so they go out as JSON
  made of them, an argument at a time, not as the model's text.

A call object is scanned as it arrives (`_Object`): its keys in any order, `arguments` or
`parameters` for the arguments. The call is sent once its name is known and its arguments have
begun (an object without arguments: `{}` at its end), and from then on its arguments as the model
writes them: the arguments are the model's own text of that JSON object, not re-serialised. A call
is never taken back, so a call cut short (out of tokens) arrives cut short, with the answer's
finish_reason `length`, as OpenAI's do, and one that goes wrong after its arguments began stays as
far as it was read (a whole answer the same: `parse` is a stream fed at once). Until a call has
begun nothing that could be one is sent; an answer whose first call does not read as one (not an
object, a name that is not a string, arguments that are not an object) is content after all, sent
whole at that point, and a bad object after good calls ends the calls (the rest is dropped).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from lorafleet.worker.openai.pythonic_call import PythonicCall

_WS = " \t\r\n"
_NAME_KEYS, _ARG_KEYS = ("name",), ("arguments", "parameters")


class _Object:
    """One call object's scan, from its `{` at `start` in a growing text: the name (when its string
    is whole), where the arguments start and end, where the object ends, or that it is not a call
    (`bad`). Only the top level is read: inside a value, strings and nesting are tracked."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_str, self.escaped = start + 1, 1, False, False
        self.phase, self.key, self.key_start, self.value_start = "key", None, 0, 0
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None  # just past the closing brace
        self.bad = False

    def scan(self, text: str) -> None:
        i = self.pos
        while i < len(text) and self.end is None and not self.bad:
            c = text[i]
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 1:
                        self._string_closed(text, i + 1)
            elif self.depth > 1:
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 1:
                        self._value_done(text, i + 1)
            else:
                self._top(text, i, c)
            i += 1
        self.pos = i

    def _top(self, text: str, i: int, c: str) -> None:
        """A character outside any value of the object's own level."""
        phase = self.phase
        if phase == "scalar" and c not in ",}":
            return
        if c in _WS:
            return
        if phase == "key" and c == '"':
            self.in_str, self.key_start, self.phase = True, i, "in_key"
        elif phase == "colon" and c == ":":
            self.phase = "value"
        elif phase == "value":
            self.value_start = i
            if (self.key in _NAME_KEYS and c != '"') or (self.key in _ARG_KEYS and c != "{"):
                self.bad = True
            elif self.key in _ARG_KEYS and self.args_start is None:
                self.args_start = i
            if c == '"':
                self.in_str, self.phase = True, "in_value"
            elif c in "{[":
                self.depth, self.phase = 2, "in_value"
            else:
                self.phase = "scalar"
        elif phase in ("after", "scalar", "key") and c == "}":
            self.end = i + 1
        elif phase in ("after", "scalar") and c == ",":
            self.phase = "key"
        else:
            self.bad = True

    def _string_closed(self, text: str, end: int) -> None:
        if self.phase == "in_key":
            self.key, self.phase = _string(text[self.key_start : end]), "colon"
        else:
            self._value_done(text, end)

    def _value_done(self, text: str, end: int) -> None:
        if self.key in _NAME_KEYS and self.name is None:
            self.name = _string(text[self.value_start : end])
            self.bad = self.name is None
        elif self.key in _ARG_KEYS and self.args_start == self.value_start and self.args_end is None:
            self.args_end = end
        self.phase = "after"


def _string(raw: str) -> str | None:
    try:
        return json.loads(raw)
    except ValueError:
        return None


class _Call:
    def __init__(self, index: int, name: str, args_from: int, short_id: bool = False) -> None:
        self.index, self.name, self.sent = index, name, args_from
        # Mistral's chat templates refuse ids that are not 9 letters and digits.
        self.id = uuid.uuid4().hex[:9] if short_id else f"call_{uuid.uuid4().hex[:24]}"
        self.arguments = ""

    def as_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# Each format: the marker its calls follow (None: the answer opens with them), what opens its list
# of calls and what separates two ("" for none). After a call, anything but the separator (a list's
# close, say) ends the calls; after a marker's call, the next marker begins the next.
FORMATS: dict[str, tuple[str | None, str, str]] = {
    "forced": (None, "", ""),
    "required": (None, "[", ","),
    "hermes": ("<tool_call>", "", ""),
    "llama3_json": (None, "", ";"),
    "mistral": ("[TOOL_CALLS]", "[", ","),
    "pythonic": (None, "[", ","),
}
SPECIAL_MARKERS = frozenset({"mistral"})  # formats whose marker is a special token: kept in the text
_PYTHON_TAG = "<|python_tag|>"  # llama3_json's optional lead, when the tokenizer keeps it
_ARGS = "[ARGS]"  # mistral's newer form: [TOOL_CALLS]name[ARGS]{...}


class CallStream:
    """One answer's calls as its text arrives: `feed(delta)` and at the end `finish()` each return
    (content to send, `tool_calls` delta entries); `calls` is what has been read."""

    def __init__(self, fmt: str, forced: str | None = None) -> None:
        self.marker, self.opens, self.separator = FORMATS[fmt]
        self.fmt, self.forced = fmt, forced
        self.text, self.pos, self.sent = "", 0, 0  # what arrived, how far it is read, sent as content
        self.state = "content" if self.marker else "lead"
        self.obj: _Object | None = None
        self.py: PythonicCall | None = None  # the pythonic call being read
        self.begun = False  # the object being read has been sent as a call
        self.calls: list[_Call] = []
        self._pending: list[str] = []
        self._entries: dict[int, dict[str, Any]] = {}

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        self._read()
        return self._out()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What was held back: content after all if no call began."""
        if not self.calls and self.state not in ("between", "done"):
            self._send_content(len(self.text))
        return self._out()

    # -- reading ----------------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            state = self.state
            getattr(self, f"_at_{state}")()
            if self.state == state:
                return

    def _at_content(self) -> None:  # before the marker: content, less a tail that could begin it
        self._find_marker(send=True)

    def _at_between(self) -> None:  # after a call, before the next marker: dropped
        self._find_marker(send=False)

    def _find_marker(self, send: bool) -> None:
        at = self.text.find(self.marker, self.pos)
        if at < 0:
            keep = next((n for n in range(min(len(self.marker) - 1, len(self.text) - self.pos), 0, -1)
                         if self.text.endswith(self.marker[:n])), 0)
            self.pos = len(self.text) - keep
            if send:
                self._send_content(self.pos)
            return
        if send:
            self._send_content(at)
        self.pos, self.state = at + len(self.marker), "open"

    def _at_lead(self) -> None:  # an answer that must open with its calls
        if self.fmt == "forced":
            self._begin_call(self.forced or "", 0)
            self.state = "forced_args"
            return
        head = self.text[self.pos :].lstrip(_WS)
        if self.fmt == "llama3_json" and head and _PYTHON_TAG.startswith(head) and head != _PYTHON_TAG:
            return  # could still be the tag
        if self.fmt == "llama3_json" and head.startswith(_PYTHON_TAG):
            self.pos = self.text.index(_PYTHON_TAG, self.pos) + len(_PYTHON_TAG)
        self.state = "open" if head else "lead"

    def _at_forced_args(self) -> None:
        self._send_arguments(self.calls[0], len(self.text))

    def _at_open(self) -> None:  # the list's opening, if the format has one, then an object
        if self.fmt == "mistral" and self._next() not in (None, "["):
            self.state = "name"  # the newer form: [TOOL_CALLS]name[ARGS]{...}
        elif not self.opens or self._expect(self.opens):
            self.state = "object"

    def _at_name(self) -> None:  # mistral's newer form: the name, up to [ARGS]
        at = self.text.find(_ARGS, self.pos)
        if at < 0:
            if any(c in self.text[self.pos :] for c in "{}\n"):
                self._fail()  # not a name
            return
        name = self.text[self.pos : at].strip()
        self.pos = at + len(_ARGS)
        if not name:
            self._fail()
            return
        self._begin_call(name, 0)
        self.state = "bare_args"

    def _at_bare_args(self) -> None:  # the arguments object after [ARGS]
        c = self._next()
        if c is None:
            return
        if c != "{":
            self.state = "between"  # not an object: the call stays as it is, without arguments
            return
        self.obj, self.state = _Object(self.pos), "in_bare_args"
        self.calls[-1].sent = self.pos

    def _at_in_bare_args(self) -> None:
        obj = self.obj
        obj.scan(self.text)  # read as a call object would be: only its end matters here
        end = obj.end if obj.end is not None else obj.pos
        self._send_arguments(self.calls[-1], end)
        if obj.end is not None:
            self.pos, self.state = obj.end, "between"

    def _at_object(self) -> None:
        c = self._next()
        if c is None:
            return
        if self.fmt == "pythonic" and (c.isalpha() or c == "_"):
            self.py, self.begun, self.state = PythonicCall(self.pos), False, "in_call"
            return
        if c != "{" or self.fmt == "pythonic":
            self._fail()
            return
        self.obj, self.begun, self.state = _Object(self.pos), False, "in_object"

    def _at_in_call(self) -> None:  # pythonic: name(key=literal, ...)
        py = self.py
        py.scan(self.text)
        if not self.begun and py.name is not None and (py.args or py.end is not None):  # as _at_in_object
            self._begin_call(py.name, 0)
            self.begun = True
        if self.begun:
            self._add_arguments(self.calls[-1], py.arguments_pieces())
        if py.bad:
            self._fail()
        elif py.end is not None:
            self.pos, self.state = py.end, "after"

    def _at_in_object(self) -> None:
        obj = self.obj
        obj.scan(self.text)
        # Begun whether or not the object went bad since: a stream fed in pieces begins it the
        # moment its arguments do, so a whole answer must too.
        if not self.begun and obj.name is not None and (obj.args_start is not None or obj.end is not None):
            call = self._begin_call(obj.name, obj.args_start if obj.args_start is not None else 0)
            self.begun = True
            if obj.args_start is None:  # no arguments: an empty object
                call.arguments = "{}"
                self._entry(call.index, arguments="{}")
        if self.begun and obj.args_start is not None:
            self._send_arguments(self.calls[-1], obj.args_end if obj.args_end is not None else obj.pos)
        if obj.bad:
            self._fail()
        elif obj.end is not None:
            self.pos, self.state = obj.end, "after"

    def _at_after(self) -> None:  # after a call object: the next one, or the end of the calls
        c = None if not self.separator else self._next()
        if self.separator and c is None:
            return
        if c == self.separator:
            self.pos += 1
            self.state = "object"
        else:  # the list's close, or anything else: the calls end, or a marker begins more
            self.state = "between" if self.marker else "done"

    def _at_done(self) -> None:
        pass

    def _at_all_content(self) -> None:
        self._send_content(len(self.text))

    def _fail(self) -> None:
        """A call that does not read as one: content after all if it was the first, else the end."""
        self.state = "done" if self.calls else "all_content"

    # -- helpers ----------------------------------------------------------------------------------

    def _next(self) -> str | None:
        """The next character that is not whitespace (`pos` moved to it), or None for none yet."""
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else None

    def _expect(self, token: str) -> bool:
        c = self._next()
        if c is None:
            return False
        if c != token:
            self._fail()
            return False
        self.pos += 1
        return True

    def _begin_call(self, name: str, args_from: int) -> _Call:
        """A new call, sent as its first entry (id, name); its arguments from `args_from` in the text."""
        call = _Call(len(self.calls), name, args_from, short_id=self.fmt == "mistral")
        self.calls.append(call)
        self._entry(call.index, id=call.id, name=name)
        return call

    def _send_content(self, upto: int) -> None:
        if upto > self.sent:
            self._pending.append(self.text[self.sent : upto])
            self.sent = upto

    def _send_arguments(self, call: _Call, upto: int) -> None:
        if upto > call.sent:
            self._add_arguments(call, self.text[call.sent : upto])
            call.sent = upto

    def _add_arguments(self, call: _Call, piece: str) -> None:
        if piece:
            call.arguments += piece
            self._entry(call.index, arguments=piece)

    def _entry(self, index: int, *, id: str | None = None, name: str | None = None, arguments: str = "") -> None:
        entry = self._entries.get(index)
        if entry is None:
            entry = self._entries[index] = {"index": index}
            if id is not None:
                entry.update(id=id, type="function", function={"name": name, "arguments": ""})
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += arguments

    def _out(self) -> tuple[str, list[dict[str, Any]]]:
        content, entries = "".join(self._pending), list(self._entries.values())
        self._pending, self._entries = [], {}
        return content, entries


def parse(fmt: str, text: str, forced: str | None = None) -> tuple[str, list[dict[str, Any]] | None]:
    """A whole answer read as a stream reads it: (its content, its calls as a message's `tool_calls`,
    None if it made none)."""
    stream = CallStream(fmt, forced)
    content = stream.feed(text)[0] + stream.finish()[0]
    return content, [c.as_message() for c in stream.calls] or None

"""Function calling in chat, as vLLM does it: a named `tool_choice` or `"required"` turns into a
structured-output constraint (worker/structured.py) and the constrained answer comes back as
`tool_calls`; `"auto"` parses the calls out of a free answer in the model's own format.

- `tool_choice: {"type": "function", "function": {"name": X}}`: the answer is X's arguments, a JSON
  object held to X's `parameters` schema; one call, finish_reason "stop" (OpenAI's, for a forced call).
- `tool_choice: "required"`: the answer is a JSON array of one or more `{"name", "parameters"}`
  objects, each held to its tool's schema; a call each, finish_reason "tool_calls".
- `"none"`: no call (the tools still reach the chat template).
- `"auto"` (the default with tools): the model decides, in its own call format, which the worker
  must be told (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`, `PARSERS`): `hermes`,
  calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after any text, as
  Qwen 2.5/3 and Hermes models do; `llama3_json`, an answer that is one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;` (after an optional `<|python_tag|>`),
  as Llama 3.1-3.3 write them. Nothing constrains the answer, the calls are parsed out of it
  (streamed: the text before the first call as content, the calls whole at the end). Without a
  parser, a 400 that says to name a tool or use "required".

The tools go to the chat template as `tools`, as transformers passes them, and earlier turns'
`tool_calls` and `tool` messages reach it too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from lorafleet.worker.structured import Constraint, ConstraintError


@dataclass(frozen=True, slots=True)
class ToolPlan:
    constraint: Constraint | None  # None: "auto", the calls parsed out of a free answer
    forced: str | None  # the named tool's name; None for "required" and "auto"
    parser: str | None = None  # "auto"'s format


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema; ConstraintError (400 on `tools`) for a malformed list."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ConstraintError(f"tools.{i}", f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise ConstraintError(f"tools.{i}", f"tools.{i}.function.name must be a non-empty string")
        if not isinstance(params, dict):
            raise ConstraintError(f"tools.{i}", f"tools.{i}.function.parameters must be a JSON schema (an object)")
        if name in out:
            raise ConstraintError(f"tools.{i}", f"tools.{i}: a second tool named {name!r}")
        out[name] = params
    return out


def plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool = True,
         parser: str | None = None) -> ToolPlan | None:
    """The constraint a request's tools and tool_choice make (None: a plain answer); `parallel`
    False (OpenAI's `parallel_tool_calls`) holds "required" to one call; `parser`: the worker's
    --tool-call-parser, which "auto" needs."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ConstraintError("tool_choice", "tool_choice names a tool but the request has no tools")
        return None
    functions = _functions(tools)
    if tool_choice in (None, "auto"):
        if parser is None:
            raise ConstraintError("tool_choice", "tool_choice \"auto\" needs a parser for the model's own tool-call "
                                                 "format (start the worker with --enable-auto-tool-choice "
                                                 "--tool-call-parser hermes): name a tool, or use \"required\"")
        return ToolPlan(None, None, parser)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})
        return ToolPlan(Constraint.schema(schema, "tool_choice"), None)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ConstraintError("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in functions:
        raise ConstraintError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return ToolPlan(Constraint.schema(functions[name], "tool_choice"), name)


def answer(p: ToolPlan | None, text: str, reason: str | None) -> tuple[str | None, list[dict[str, Any]] | None,
                                                                      str | None]:
    """A finished answer as (content, tool calls, finish_reason). Under a plan, an answer that
    stopped holding whole calls gives them (content null, or under "auto" the text before them),
    "tool_calls" unless the call was forced (OpenAI's "stop"); any other answer (it ran out of
    tokens, or "auto" wrote no call) is content."""
    if p is None or reason != "stop":
        return text, None, reason
    if p.parser is not None:
        content, found = PARSERS[p.parser].calls(text)
        return content, found, reason if found is None else "tool_calls"
    try:
        value = json.loads(text)
    except ValueError:
        return text, None, reason
    if p.forced is not None:
        return None, [_call(p.forced, text)], reason
    return None, [_call(item["name"], json.dumps(item["parameters"])) for item in value], "tool_calls"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


# -- "auto": the hermes format ------------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content before the first call or None, the calls or None). A call that is not a JSON object
    with a string `name` and object `arguments` makes the whole answer content (None calls)."""
    found = []
    for match in _HERMES.finditer(text):
        try:
            item = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
        except ValueError:
            return text, None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(
                item.get("arguments", {}), dict):
            return text, None
        found.append(_call(item["name"], json.dumps(item.get("arguments", {}))))
    if not found:
        return text, None
    content = text[: text.index(_OPEN)].strip()
    return content or None, found


class _Stream:
    """A streamed answer under "auto": `feed` each text delta, for the content to send now; at the
    end `finish` parses the calls out of the whole text, or, if none parses, sends what was held
    back as content after all. Each format's subclass says what is held (`_sendable`) and how the
    calls are parsed (`calls`: text -> (content or None, calls or None))."""

    calls: Any

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.calling = False  # a call has started: nothing more is sent before the end

    def feed(self, delta: str) -> str:
        self.text += delta
        return "" if self.calling else self._send(self._sendable())

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        """(content still to send, the calls or None)."""
        _, found = self.calls(self.text)
        if found is None:
            return self._send(len(self.text)), None
        return "", found

    def _sendable(self) -> int:
        raise NotImplementedError

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out


class HermesStream(_Stream):
    """Content until `<tool_call>` (a tail that could be its start is held back), then held."""

    calls = staticmethod(hermes_calls)

    def _sendable(self) -> int:
        start = self.text.find(_OPEN, self.sent)
        if start >= 0:
            self.calling = True
            return start
        keep = next((n for n in range(min(len(_OPEN) - 1, len(self.text) - self.sent), 0, -1)
                     if self.text.endswith(_OPEN[:n])), 0)
        return len(self.text) - keep


# -- "auto": the llama3_json format -----------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


def llama3_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(None, the calls) when the whole answer is calls: after whitespace and an optional
    `<|python_tag|>`, JSON objects with a string `name` and object `parameters` (or `arguments`),
    separated by `;`; else (the text, None)."""
    rest = text.strip()
    rest = rest[len(_PYTHON_TAG):].lstrip() if rest.startswith(_PYTHON_TAG) else rest
    if not rest.startswith("{"):
        return text, None
    decoder, found = json.JSONDecoder(), []
    while rest:
        try:
            item, end = decoder.raw_decode(rest)
        except ValueError:
            return text, None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return text, None
        args = item.get("parameters", item.get("arguments", {}))
        if not isinstance(args, dict):
            return text, None
        found.append(_call(item["name"], json.dumps(args)))
        rest = rest[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, None
    return None, found


class Llama3JsonStream(_Stream):
    """Content unless the answer opens as a call (`{` or `<|python_tag|>` after any whitespace):
    then all of it is held. Leading whitespace is held until that is known."""

    calls = staticmethod(llama3_calls)

    def __init__(self) -> None:
        super().__init__()
        self.content = False  # the answer is known not to open with a call

    def _sendable(self) -> int:
        head = self.text.lstrip()
        if not self.content:
            if not head or _PYTHON_TAG.startswith(head):
                return self.sent  # undecided
            if head.startswith(("{", _PYTHON_TAG)):
                self.calling = True
                return self.sent
            self.content = True
        return len(self.text)


# --tool-call-parser NAME (vLLM's names for these formats): its streamed answer, whose `calls` parses a whole one.
PARSERS: dict[str, type[_Stream]] = {"hermes": HermesStream, "llama3_json": Llama3JsonStream}

"""Function calling in chat, as vLLM does it: a named `tool_choice` or `"required"` turns into a
structured-output constraint (worker/sampling/structured.py) and the constrained answer comes back as
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
  as Llama 3.1-3.3 write them; `mistral`, `[TOOL_CALLS]` then a JSON array of
  `{"name": ..., "arguments": {...}}` objects, or `[TOOL_CALLS]name[ARGS]{...}` a call, after any
  text (Mistral's models; the answer's text keeps special tokens, as `[TOOL_CALLS]` is one, and call
  ids are 9 characters, as Mistral's templates require); `pythonic`, an answer that is a Python list
  of calls, `[name(key=literal, ...), ...]` (Llama 3.2, Llama 4; the arguments become JSON).
  Nothing constrains the answer, the calls are read out of it.
  Without a parser, a 400 that says to name a tool or use "required".

Every answer under a plan is read as it is written (worker/openai/tool_parsers.py): streamed, a call's
arguments go out piece by piece as the model writes them, and a whole answer is read by the same
code, so both give the same calls; a call cut short by max_tokens comes back cut short, with
finish_reason "length".

The tools go to the chat template as `tools`, as transformers passes them, and earlier turns'
`tool_calls` and `tool` messages reach it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafleet.worker.openai.tool_parsers import CallStream, parse
from lorafleet.worker.sampling.structured import Constraint, ConstraintError


@dataclass(frozen=True, slots=True)
class ToolPlan:
    constraint: Constraint | None  # None: "auto", the calls parsed out of a free answer
    forced: str | None  # the named tool's name; None for "required" and "auto"
    parser: str | None = None  # "auto"'s format

    @property
    def format(self) -> str:
        """How the answer holds its calls (worker/openai/tool_parsers.py FORMATS)."""
        return self.parser or ("forced" if self.forced is not None else "required")


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


def stream(p: ToolPlan) -> CallStream:
    """A streamed answer's reader under a plan (worker/openai/tool_parsers.py)."""
    return CallStream(p.format, p.forced)


def answer(p: ToolPlan | None, text: str, reason: str | None) -> tuple[str | None, list[dict[str, Any]] | None,
                                                                      str | None]:
    """A finished answer as (content, tool calls, finish_reason), read as its stream is: the calls
    it made (content null, or under "auto" the text before them), content if it made none."""
    if p is None:
        return text, None, reason
    content, calls = parse(p.format, text, p.forced)
    if calls is None:
        return content, None, reason
    return content.rstrip(_WS) or None, calls, finish_reason(p, calls, reason)


def finish_reason(p: ToolPlan, calls: list[Any] | None, reason: str | None) -> str | None:
    """"tool_calls" for an answer that stopped after making calls, unless the call was forced
    (OpenAI's "stop"); else the answer's own reason ("length": a call cut short)."""
    return "tool_calls" if calls and reason == "stop" and p.forced is None else reason


_WS = " \t\r\n"

# --tool-call-parser NAME (vLLM's names for these formats).
PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "mistral", "pythonic")

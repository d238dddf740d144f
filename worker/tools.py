"""Function calling in chat, as vLLM does it without a model-specific tool-call parser: a named
`tool_choice` or `"required"` turns into a structured-output constraint (worker/structured.py) and
the constrained answer comes back as `tool_calls`.

- `tool_choice: {"type": "function", "function": {"name": X}}`: the answer is X's arguments, a JSON
  object held to X's `parameters` schema; one call, finish_reason "stop" (OpenAI's, for a forced call).
- `tool_choice: "required"`: the answer is a JSON array of one or more `{"name", "parameters"}`
  objects, each held to its tool's schema; a call each, finish_reason "tool_calls".
- `"none"`: no call (the tools still reach the chat template); `"auto"` (the default with tools)
  would need a parser for the model's own call format: a 400 that says to name a tool or use
  "required".

The tools go to the chat template as `tools`, as transformers passes them, and earlier turns'
`tool_calls` and `tool` messages reach it too.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lorafleet.worker.structured import Constraint, ConstraintError


@dataclass(frozen=True, slots=True)
class ToolPlan:
    constraint: Constraint
    forced: str | None  # the named tool's name; None for "required"


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


def plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool = True) -> ToolPlan | None:
    """The constraint a request's tools and tool_choice make (None: a plain answer); `parallel`
    False (OpenAI's `parallel_tool_calls`) holds "required" to one call."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ConstraintError("tool_choice", "tool_choice names a tool but the request has no tools")
        return None
    functions = _functions(tools)
    if tool_choice in (None, "auto"):
        raise ConstraintError("tool_choice", "tool_choice \"auto\" needs a parser for the model's own tool-call "
                                             "format, which this worker has not: name a tool, or use \"required\"")
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


def calls(p: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The answer's tool calls (OpenAI's shape), or None when `text` is not a whole call (it ran
    out of tokens): then it is returned as content."""
    if p.forced is not None:
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(p.forced, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    return [_call(item["name"], json.dumps(item["parameters"])) for item in items]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}

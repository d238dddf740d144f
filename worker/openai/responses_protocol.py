"""OpenAI's Responses API request (`POST /v1/responses`), read as the chat request it amounts to:
`instructions` and `input` become the messages, `max_output_tokens`, `text.format`, the flat
function `tools` and `tool_choice`, and `include`'s logprobs become chat's fields, so sampling,
structured outputs, tool calls and reasoning run exactly as chat runs them
(worker/openai/protocol.py). The answer's shape is worker/openai/response_writer.py. Torch-free.

Stateless, as vLLM is by default: `store` is taken and reported false, nothing is kept, so
`previous_response_id`, `background` and `conversation` (which need stored responses) are refused
with a reason. vLLM's extra sampling fields (`seed`, `top_k`, `stop`, `lora_adapters`, ...) pass to
the chat request as they are; chat's own spellings of what this API names differently (`messages`,
`max_tokens`, `response_format`, `n`, ...) are a 400 naming the field to use instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from lorafleet.protocol import JsonBody, field_path
from lorafleet.worker.openai.protocol import ChatCompletionRequest, UnsupportedField

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values that ask for nothing this worker could add (no encrypted reasoning is made).
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})

# Chat's names for what this API spells otherwise: a 400 saying which field to use.
CHAT_ONLY: dict[str, str] = {
    "messages": "use input (and instructions)",
    "max_tokens": "use max_output_tokens",
    "max_completion_tokens": "use max_output_tokens",
    "response_format": "use text.format",
    "logprobs": f"use include: [{LOGPROBS_INCLUDE!r}] with top_logprobs",
    "n": "a response has one answer",
    "best_of": "a response has one answer",
    "echo": "not a Responses API field",
    "prompt_logprobs": "not a Responses API field",
    "add_generation_prompt": "a response always answers as the assistant",
}

# Fields that need stored responses or features this worker does not have: any value but null is a 400.
UNSUPPORTED: dict[str, str] = {
    "conversation": "conversation needs stored responses, which this server does not keep: send the turns in input",
    "prompt": "prompt (stored prompt templates) is not supported: send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported",
}


class BadField(ValueError):
    """A malformed field: HTTP 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Part(JsonBody):
    type: str
    text: str | None = None
    refusal: str | None = None


class _Message(JsonBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]


class _FunctionCall(JsonBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(JsonBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]


_ITEMS: dict[str, type[JsonBody]] = {
    "message": _Message, "function_call": _FunctionCall, "function_call_output": _FunctionCallOutput,
}
# Text parts: a user's input_text, an earlier assistant turn's output_text or refusal.
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text(parts: str | list[_Part], param: str) -> str:
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        key = _TEXT_PARTS.get(part.type)
        if key is None:
            raise UnsupportedField(f"{param}.{j}", f"content part type {part.type!r} is not supported (text only)")
        value = getattr(part, key)
        if value is None:
            raise BadField(f"{param}.{j}", f"a content part of type {part.type!r} is missing its {key!r} string")
        out.append(value)
    return "".join(out)


def _validated(model: type[JsonBody], item: dict[str, Any], param: str) -> Any:
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = field_path(first["loc"], param)
        raise BadField(where, f"{where}: {first['msg']}") from None


class ResponsesRequest(JsonBody):
    """The request body; fields not listed are kept (`model_extra`) and go to the chat request."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # OpenAI's include_obfuscation: nothing to obfuscate here
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # effort / summary: reported back, the model decides
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Raises UnsupportedField (HTTP 400) for what this stateless worker cannot do."""
        for name, value in (self.model_extra or {}).items():
            if value is None:
                continue
            if name in CHAT_ONLY:
                raise UnsupportedField(name, f"{name} is a chat completions field: {CHAT_ONLY[name]}")
            if name in UNSUPPORTED:
                raise UnsupportedField(name, UNSUPPORTED[name])
        if self.background:
            raise UnsupportedField("background", "background needs stored responses, which this server does not keep")
        if self.truncation == "auto":
            raise UnsupportedField("truncation", "truncation 'auto' is not supported: an input too long is refused")
        for value in self.include or ():
            if value != LOGPROBS_INCLUDE and value not in HARMLESS_INCLUDES:
                raise UnsupportedField("include", f"include {value!r} is not supported")
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` (a system message first) and `input` as chat messages: message items as
        they are, an assistant's `function_call` items as its `tool_calls` (consecutive ones in one
        turn), each `function_call_output` a tool message; earlier `reasoning` items are dropped, as
        chat templates drop an earlier turn's reasoning."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise BadField("input", "input must not be empty")
        for i, item in enumerate(self.input):
            param = f"input.{i}"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "reasoning":
                continue
            if kind == "item_reference":
                raise UnsupportedField(param, "item_reference needs stored responses, which this server does not keep")
            model = _ITEMS.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise UnsupportedField(param, f"input item type {kind!r} is not supported")
            parsed = _validated(model, item, param)
            if isinstance(parsed, _Message):
                out.append({"role": parsed.role, "content": _text(parsed.content, f"{param}.content")})
            elif isinstance(parsed, _FunctionCall):
                call = {"id": parsed.call_id, "type": "function",
                        "function": {"name": parsed.name, "arguments": parsed.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": parsed.call_id,
                            "content": _text(parsed.output, f"{param}.output")})
        if not out:
            raise BadField("input", "input has no message")
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The flat function tools (`{"type": "function", "name", "parameters", ...}`) in chat's nested form."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise UnsupportedField(f"tools.{i}", f"tool type {kind!r} is not supported (function tools only)")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise BadField(f"tools.{i}.name", f"tools.{i} needs a name")
            fn = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise UnsupportedField("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                              "{\"type\": \"function\", \"name\": ...}")

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if "schema" not in fmt:
                raise BadField("text.format", "text.format json_schema needs a schema")
            spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
            return {"type": "json_schema", "json_schema": spec}
        raise BadField("text.format", "text.format type must be text, json_object or json_schema")

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one amounts to; BadField / UnsupportedField (400s naming the field)."""
        self.check_supported()
        body: dict[str, Any] = dict(self.model_extra or {})
        body.update(model=self.model, messages=self.messages(), stream=self.stream, temperature=self.temperature,
                    top_p=self.top_p, max_completion_tokens=self.max_output_tokens, tools=self.chat_tools(),
                    tool_choice=self.chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
                    response_format=self.response_format(), logprobs=self.logprobs,
                    top_logprobs=self.top_logprobs if self.logprobs else None)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # a passed-on extra field of the wrong type (seed: "1", ...)
            first = exc.errors()[0]
            where = field_path(first["loc"])
            raise BadField(where, f"{where}: {first['msg']}") from None

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object reports them (OpenAI's defaults where unset)."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs,
            "tool_choice": "auto" if self.tool_choice is None else self.tool_choice,
            "tools": self.tools or [],
            "text": self.text if self.text is not None else {"format": {"type": "text"}},
            "reasoning": self.reasoning,
            "store": False,  # nothing is kept (vLLM's default too)
            "background": False,
            "previous_response_id": None,
            "truncation": "disabled",
            "metadata": self.metadata or {},
            "user": self.user,
        }

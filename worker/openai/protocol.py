"""OpenAI request bodies (with vLLM's extra sampling fields and the RFC's `lora_adapters`); the
response and stream-chunk shapes are worker/openai/response_shapes.py. Torch-free.

Request fields keep JSON's types (pydantic's strict mode): `max_tokens: true` or `"stream": "false"`
is a 400, not 1 or false by coercion. JSON `null` for an optional field means "not given", as in
OpenAI's API. A field this worker does not implement (`tools` in completions, the legacy
`functions`, vLLM's `use_beam_search`, ...) is a 400 naming it unless its value changes nothing;
other unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from lorafleet.protocol import MAX_N, MAX_TOKENS_ZERO, JsonBody, LoraAdapterRef
from lorafleet.worker.engine.sequence import SEED_MAX, SamplingParams
from lorafleet.worker.engine.tokenizer import TEMPLATE_VARIABLES
from lorafleet.worker.openai.tool_parsers import SPECIAL_MARKERS
from lorafleet.worker.openai.tools import ToolPlan
from lorafleet.worker.openai.tools import plan as tools_plan
from lorafleet.worker.sampling.structured import Constraint, requested_constraint


class UnsupportedField(ValueError):
    """A field we parse but do not implement, set to a value that would change the output."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(JsonBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, every chunk carries its choice's usage


def _off(*harmless: Any) -> Callable[[Any], bool]:
    """A check that a field's value changes nothing: null, empty, or one of `harmless`."""
    return lambda v: v is None or v in ([], {}, "") or any(type(v) is type(h) and v == h for h in harmless)


def _text_modalities(v: Any) -> bool:
    return v is None or (isinstance(v, list) and all(m == "text" for m in v))


# Fields a client may send that this worker does not implement: each is accepted only at a value that
# changes nothing (check, what is not supported); any other value is a 400 naming the field rather
# than an answer that silently ignores it (a JSON schema not followed, a tool never called).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_off(), "tools (function calling) are not supported"),
    "tool_choice": (_off("none", "auto"), "tool_choice other than 'none' or 'auto' is not supported (no tools)"),
    "functions": (_off(), "functions (function calling) are not supported"),
    "function_call": (_off("none", "auto"), "function_call other than 'none' or 'auto' is not supported"),
    "modalities": (_text_modalities, "modalities other than ['text'] are not supported"),
    "audio": (_off(), "audio output is not supported"),
    # vLLM's extra parameters (vLLM 0.32's CompletionRequest and ChatCompletionRequest; docs/worker.md
    # lists every one with what this worker does with it)
    "use_beam_search": (_off(False), "use_beam_search is not supported"),
    "logits_processors": (_off(), "logits_processors is not supported"),
    "length_penalty": (_off(1.0, 1), "length_penalty is not supported (it applies to beam search)"),
    "watermarking": (_off(), "watermarking is not supported"),
    "spaces_between_special_tokens": (_off(True), "spaces_between_special_tokens false is not supported"),
    "truncate_prompt_tokens": (_off(), "truncate_prompt_tokens is not supported"),
    "truncation_side": (_off("left", "right"), "truncation_side must be 'left' or 'right'"),
    "logprob_token_ids": (_off(), "logprob_token_ids is not supported"),
    "prompt_embeds": (_off(), "prompt_embeds is not supported"),
    "priority": (_off(0), "priority is not supported (requests are served first come, first served)"),
    "request_id": (_off(), "request_id is not supported (the server names each request)"),
    "session_id": (_off(), "session_id is not supported"),
    "return_token_ids": (_off(False), "return_token_ids is not supported"),
    "routed_experts_prompt_start": (_off(0), "routed_experts_prompt_start is not supported"),
    "return_token_offsets": (_off(False), "return_token_offsets is not supported"),
    "mm_payload": (_off("tensors"), "mm_payload is not supported (text only)"),
    "return_mm_kwargs": (_off(False), "return_mm_kwargs is not supported (text only)"),
    "cache_salt": (_off(), "cache_salt is not supported (the prefix cache is salted per tenant)"),
    "kv_transfer_params": (_off(), "kv_transfer_params is not supported"),
    "ec_transfer_params": (_off(), "ec_transfer_params is not supported"),
    "vllm_xargs": (_off(), "vllm_xargs is not supported"),
    "repetition_detection": (_off(), "repetition_detection is not supported"),
    "thinking_token_budget": (_off(), "thinking_token_budget is not supported"),
    "stream_interval": (_off(1), "stream_interval is not supported (every token is streamed)"),
}

# vLLM fields of one endpoint only: a completions request naming a chat field is ignored, as vLLM does.
COMPLETION_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "add_special_tokens": (_off(True), "add_special_tokens false is not supported in completions"),
}
CHAT_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "include_reasoning": (_off(True), "include_reasoning false is not supported"),
    "continue_final_message": (_off(False), "continue_final_message is not supported"),
    "add_special_tokens": (_off(False), "add_special_tokens is not supported in chat (the template writes them)"),
    "documents": (_off(), "documents is not supported"),
    "chat_template": (_off(), "chat_template is not supported (the model's own template is used)"),
    "media_io_kwargs": (_off(), "media_io_kwargs is not supported (text only)"),
    "mm_processor_kwargs": (_off(), "mm_processor_kwargs is not supported (text only)"),
    "return_prompt_text": (_off(False), "return_prompt_text is not supported"),
}


class _SamplingFields(JsonBody):
    """Fields shared by completions and chat; unknown fields are ignored, as OpenAI and vLLM do
    (kept, so the ones in UNSUPPORTED can be checked)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions' echo alone (check_supported)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> -100..100
    best_of: int | None = None  # completions in OpenAI's API; vLLM's chat takes it too
    echo: bool = False  # completions: the prompt before the text; vLLM's chat: the last message
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens `token_id:N` (vLLM's)
    # The RFC's composition field: several adapters with static scales (then `model` is the base)
    lora_adapters: list[LoraAdapterRef] | None = None
    # Structured outputs (worker/sampling/structured.py): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs; at most one of them constrains a request.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None  # a schema (object) or its JSON text: Constraint.schema says which is wrong
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raises UnsupportedField (HTTP 400) for a field set to a value this worker cannot honour."""
        if self.best_of is not None and self.best_of < self.n:
            raise UnsupportedField("best_of", "best_of must be greater than or equal to n")
        if self.best_of is not None and self.best_of > self.n:
            raise UnsupportedField("best_of", "best_of greater than n is not supported")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed when stream is true")
        for name, value in (self.model_extra or {}).items():
            rule = UNSUPPORTED.get(name) or self.unsupported_here().get(name)
            if rule is not None and not rule[0](value):
                raise UnsupportedField(name, rule[1])

    @classmethod
    def unsupported_here(cls) -> dict[str, tuple[Callable[[Any], bool], str]]:
        """This endpoint's own unimplemented vLLM fields (beside UNSUPPORTED)."""
        return {}

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                 tool_parser: str | None = None) -> SamplingParams:
        """Raises ValueError (HTTP 400) for values the engine refuses."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens and not self.keeps_special_tokens(tool_parser),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            logit_bias=self._logit_bias(),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()),
            constraint=self.constraint(tool_parser),
        )

    def keeps_special_tokens(self, tool_parser: str | None) -> bool:
        """Whether the answer's text must keep special tokens whatever the request says (chat's
        tool calls in a format that a special token opens)."""
        return False

    def constraint(self, tool_parser: str | None = None) -> Constraint | None:
        """The one structured-output constraint the request asks for (None: free text); a 400 naming
        the field for a malformed one or for two at once. (`tool_parser`: chat's, for its tools.)"""
        return requested_constraint(self.response_format, self.guided_json, self.guided_regex, self.guided_choice,
                                    self.guided_grammar, self.structured_outputs)

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias's keys as token ids; raises UnsupportedField (a 400 naming it) for another key."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            # Decimal digits only: int() would also take " 5", "+5", "5_0" (50) and non-ASCII digits.
            if not (key.isascii() and key.isdigit()):
                raise UnsupportedField("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            pairs.append((int(key), bias))
        return tuple(pairs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: per-chunk usage needs include_usage too."""
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)


def per_choice(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of a prompt's `n` choices. Seeded, choice i draws from seed + i (vLLM's
    rule): the choices differ, and the same request gives them again. Past the top of the seed
    range, seed + i wraps to its negative form, which torch takes as the same seed."""
    if sampling.seed is None:
        return [sampling] * n
    seeds = [sampling.seed + i for i in range(n)]
    return [dataclasses.replace(sampling, seed=s - 2**64 if s > SEED_MAX else s) for s in seeds]


PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: each prompt token's logprob

    @classmethod
    def unsupported_here(cls) -> dict[str, tuple[Callable[[Any], bool], str]]:
        return COMPLETION_UNSUPPORTED

    def prompt_k(self) -> int | None:
        """The prompt logprobs to compute: vLLM's prompt_logprobs, else echo's (OpenAI's legacy
        echo with logprobs scores the prompt's tokens as well)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One message naming the four shapes, not the first union member's ("prompt.str: ...")."""
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("prompt_type", f"must be {PROMPT_SHAPES}") from None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedField("prompt", "prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedField("max_tokens", MAX_TOKENS_ZERO)
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported")

    def echo_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's legacy way to score a prompt): the prompt comes back,
        nothing is generated (the engine samples one token, which is dropped)."""
        return self.echo and self.max_tokens == 0


class TextPart(JsonBody):
    type: str
    text: str | None = None


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(TEMPLATE_VARIABLES & set(value or ()))
    if taken:
        raise ValueError(f"{', '.join(taken)} cannot be set here: the server sets them")
    return value


# vLLM's chat_template_kwargs: more variables for the chat template (enable_thinking, ...).
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)]


class ChatMessage(JsonBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (worker/openai/tools.py)
    tool_call_id: str | None = None  # a tool turn's answer to one of them

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' dicts): role, text, and the tool fields."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise UnsupportedField("messages", f"content part type {part.type!r} is not supported (text only)")
            if part.text is None:
                raise ValueError("a content part of type 'text' is missing its 'text' string")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's, once for the request
    tools: list[dict[str, Any]] | None = None  # function calling (worker/openai/tools.py)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: "required" makes one call
    chat_template_kwargs: TemplateKwargs = None
    reasoning_effort: str | None = None  # OpenAI's; reaches the chat template as vLLM passes it

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0:
            raise UnsupportedField("max_tokens", "max_tokens: Input should be greater than or equal to 1")
        if self.stream and self.prompt_logprobs is not None:
            raise UnsupportedField("prompt_logprobs", "prompt_logprobs is not available when stream is true (as in vLLM)")

    @classmethod
    def unsupported_here(cls) -> dict[str, tuple[Callable[[Any], bool], str]]:
        return CHAT_UNSUPPORTED

    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's text, when it has the answer's role (assistant, or
        any role without a generation prompt: the answer continues that message); else ""."""
        last = self.messages[-1]
        return last.text() if self.echo and (not self.add_generation_prompt or last.role == "assistant") else ""

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables, as vLLM builds them: chat_template_kwargs, with
        `reasoning_effort` when given and `enable_thinking` (effort other than "none") unless set."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def tool_plan(self, parser: str | None = None) -> ToolPlan | None:
        """How the answer's tool calls are made (worker/openai/tools.py), or None; `parser`: the worker's
        --tool-call-parser."""
        return tools_plan(self.tools, self.tool_choice, self.parallel_tool_calls is not False, parser)

    def keeps_special_tokens(self, tool_parser: str | None) -> bool:
        tool = self.tool_plan(tool_parser)
        return tool is not None and tool.parser in SPECIAL_MARKERS

    def constraint(self, tool_parser: str | None = None) -> Constraint | None:
        own, tool = super().constraint(), self.tool_plan(tool_parser)
        held = tool.constraint if tool is not None else None
        if own is not None and held is not None:
            raise UnsupportedField("tool_choice", f"a tool call and {own.param} both constrain the answer: one a request")
        return held or own

    def logprobs_k(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0

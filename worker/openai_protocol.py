"""OpenAI request bodies (with vLLM's extra sampling fields and the RFC's `lora_adapters`) and the
response / stream-chunk shapes, as plain builders. Torch-free; raw dicts only at this boundary.

Request fields keep JSON's types (pydantic's strict mode): `max_tokens: true` or `"stream": "false"`
is a 400, not 1 or false by coercion.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from lorafleet.protocol import LoraAdapterRef
from lorafleet.worker.sampling import TokenLogprobs
from lorafleet.worker.sequence import SamplingParams


class UnsupportedField(ValueError):
    """A field we parse but do not implement, set to a value that would change the output."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat; unknown fields are ignored, as OpenAI and vLLM do."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # The RFC's composition field: several adapters with static scales (then `model` is the base)
    lora_adapters: list[LoraAdapterRef] | None = None

    def _check_supported(self) -> None:
        if self.n != 1:
            raise UnsupportedField("n", "only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise UnsupportedField("presence_penalty", "presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported")

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (HTTP 400) for values the engine refuses."""
        self._check_supported()
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
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

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

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.echo:
            raise UnsupportedField("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedField("best_of", "best_of is not supported")
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def logprobs_k(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0


# -- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class TextOffsets:
    """Where each generated token starts in the text, in characters, one request's tokens after
    another (kept across stream chunks). Counted over the tokens' bytes: a token holding part of a
    character has no text of its own (its decoded text is U+FFFD), so each character counts once,
    and a token starts at the character holding its first byte."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, token_id: int) -> int:
        start = self._chars
        self._chars += len(self._utf8.decode(self._token_bytes(token_id)))
        return start


def completion_logprobs(lps: list[TokenLogprobs], token_text: Callable[[int], str],
                        offsets: TextOffsets) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: parallel lists per generated token."""
    return {
        "tokens": [token_text(lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} if lp.top else None for lp in lps],
        "text_offset": [offsets.next(lp.token_id) for lp in lps],
    }


def chat_logprobs(lps: list[TokenLogprobs], token_text: Callable[[int], str],
                  token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token_id), "logprob": logprob, "bytes": list(token_bytes(token_id))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices,
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_response(rid: str, model: str, text: str, finish_reason: str, logprobs: dict | None,
                  use: dict) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
        "usage": use,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}

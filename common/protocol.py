"""Wire contracts shared by the worker, the router and the operator (torch-free).

Shapes follow vLLM where vLLM has the endpoint (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`)
so that a vLLM user, and tooling written for vLLM, feel at home. `/v1/adapters` is ours: the
inventory the router routes on and the operator reconciles against.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Tier = Literal["gpu", "cpu", "disk"]

# Choices per prompt (`n`) a worker serves; the router's --max-n may only lower it. vLLM has no
# cap, but each choice is a sequence with its own KV blocks.
MAX_N = 16

# Completions take max_tokens 0 with echo only (OpenAI's legacy prompt scoring); the worker's refusal
# otherwise, which the router repeats when it refuses first.
MAX_TOKENS_ZERO = "max_tokens 0 needs echo: true (the prompt, and with logprobs its tokens' logprobs, without a completion)"

# 409 reasons of a load that passes once requests still running on an adapter's old weights finish:
# an in-place reload of a copy in use, a load of a name unloaded while its requests drain.
REASON_IN_USE = "in_use"
REASON_DRAINING = "draining"


def response_not_kept(response_id: str) -> str:
    """The 404 for a stored Responses API response asked for: workers keep none (`store` is off)."""
    return (f"Response with id {response_id!r} not found: this server keeps no responses (store is off); "
            "send the earlier turns in input")


# Internal headers the router sets towards workers; stripped from client requests.
HEADER_REPLICA = "x-lorafleet-replica"
HEADER_ROUTE_REASON = "x-lorafleet-route"
HEADER_TENANT = "x-lorafleet-tenant"
INTERNAL_HEADER_PREFIX = "x-lorafleet-"


class LoadLoraAdapterRequest(BaseModel):
    """Body of `POST /v1/load_lora_adapter` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-/]*$")
    lora_path: str = Field(min_length=1, max_length=4096)  # a folder, or s3://BUCKET/PREFIX (worker/lora/sources.py)
    load_inplace: bool = False
    # The content the caller expects (the digest `GET /v1/adapters` reports, with or without its
    # "sha256:" prefix): other content is refused with reason DigestMismatch and never served.
    sha256: str | None = Field(default=None, pattern=r"^(sha256:)?[0-9a-fA-F]{64}$")


class UnloadLoraAdapterRequest(BaseModel):
    """Body of `POST /v1/unload_lora_adapter` (vLLM's shape; `lora_int_id` accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


class JsonBody(BaseModel):
    """A JSON object of the OpenAI-style API: JSON's types kept (pydantic's strict mode: `"0.5"` or
    `true` for a number is refused, not coerced) and null for an optional field meaning "not
    given", as OpenAI takes it (`"n": null`, `"stream": null`). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class LoraAdapterRef(JsonBody):
    """One entry of the RFC's request-level `lora_adapters` field (a null scale is the default)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    scale: float = Field(default=1.0, ge=-100.0, le=100.0, allow_inf_nan=False)


class AdapterInfo(BaseModel):
    """One adapter a worker knows, as listed by `GET /v1/adapters`."""

    name: str
    tier: Tier
    rank: int
    alpha: float
    digest: str  # sha256 over the adapter's config and weights files, "sha256:<hex>"
    path: str
    requests_in_flight: int = 0
    pinned: bool = False
    last_used: float | None = None  # unix seconds
    # Seconds since its last use when the worker answered, by the worker's own clock (None: never
    # used): what the placement's idle rule reads, free of clock skew between machines.
    idle_s: float | None = None


class AdapterInventory(BaseModel):
    """`GET /v1/adapters`: what a worker holds and how busy it is."""

    model: str  # the base model's served name
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    max_loras_per_request: int
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    adapters: list[AdapterInfo] = Field(default_factory=list)

    def tier_of(self, name: str) -> Tier | None:
        for info in self.adapters:
            if info.name == name:
                return info.tier
        return None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


# pydantic names the member of a union that failed in an error's loc ("str", "list[int]",
# "function-after[...]", a model's class name): not a field, so not part of a `param`.
# (A dict's keys are in a loc too, "logit_bias.5": only what looks like a type goes.)
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|dict|list|tuple|set|bytes)|.*\[.*\]|[A-Z_]\w*"
                           r"|(function|constrained|lax-or-strict|json-or-python|tagged-union|nullable)-.*")


def field_path(loc: Iterable[Any], prefix: str = "") -> str:
    """A validation error's loc as the `param` the API names (after `prefix`, the path of what was
    validated): dotted fields and indices, without the union members pydantic tried."""
    parts = [str(part) for part in loc if not (isinstance(part, str) and _UNION_MEMBER.fullmatch(part))]
    return ".".join([prefix, *parts] if prefix else parts)


# The worker's `type` for each status: vLLM's names (the openai client's exception classes).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail

    @classmethod
    def of(cls, message: str, type_: str, code: int | str | None = None, param: str | None = None) -> ErrorResponse:
        return cls(error=ErrorDetail(message=message, type=type_, code=code, param=param))

    @classmethod
    def as_worker(cls, status: int, message: str, param: str | None = None) -> ErrorResponse:
        """The worker's envelope (vLLM's): `type` by status, `code` the status itself."""
        return cls.of(message, ERROR_TYPES.get(status, "Error"), status, param)

"""What the router reads in a proxied request before it routes it (pure): the length, count and
`stream` fields it checks in the worker's place (or caps), and the base model and adapters the
request's `model` / `lora_adapters` name."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from lorafleet.protocol import MAX_TOKENS_ZERO, LoraAdapterRef
from lorafleet.router.settings import RouterSettings

if TYPE_CHECKING:
    from lorafleet.router.gateway import Gateway

# Each path's length and count fields (the Responses API's one; the worker refuses chat's names there).
_CAPPED = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens", "n"), "/v1/responses": ("max_output_tokens",)}


def check_fields(payload: dict[str, Any], s: RouterSettings, path: str) -> tuple[str, str] | None:
    """(param, message) for a field the worker would refuse or the router caps, else None.

    The worker's rules (`worker/openai/protocol.py`): JSON null means "not given" (OpenAI's rule);
    integer fields take JSON integers, not booleans; `max_tokens` (chat's `max_completion_tokens`,
    the Responses API's `max_output_tokens`) and `n` at least 1, but completions' `max_tokens` 0
    with `echo` true (the prompt scored, nothing generated); `stream` a JSON boolean. The messages
    use the worker's (pydantic's) wording. The caps (`max_tokens_cap`, `max_n`) are the router's own.
    """
    for name, low, high in _ranges(path, s.max_n, s.max_tokens_cap):
        value = payload.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            return name, f"{name}: Input should be a valid integer"
        if name == "max_tokens" and value == 0 and path not in _CAPPED:  # completions' echo alone
            echo = payload.get("echo")
            if echo is True or not isinstance(echo, bool | None):  # an echo that is not a boolean: the worker's 400
                continue
            return name, MAX_TOKENS_ZERO
        if value < low:
            return name, f"{name}: Input should be greater than or equal to {low}"
        if value > high:
            return name, f"{name}: Input should be less than or equal to {high}"
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream", "stream: Input should be a valid boolean"
    return None


@lru_cache(maxsize=64)
def _ranges(path: str, max_n: int, max_tokens_cap: int) -> tuple[tuple[str, int, int], ...]:
    """`path`'s capped fields with their (low, high) bounds."""
    return tuple((name, 1, max_n if name == "n" else max_tokens_cap) for name in _CAPPED.get(path, ("max_tokens", "n")))


class UnknownModel(Exception):
    """The request names a model or adapter that no replica serves and the catalog lacks."""

    def __init__(self, name: str, param: str | None = None) -> None:
        super().__init__(name)
        self.name = name
        self.param = param


# `lora_adapters` as the worker parses it (absent or null: none).
ADAPTER_REFS = TypeAdapter(list[LoraAdapterRef])


def resolve(payload: dict[str, Any], gw: Gateway) -> tuple[str, tuple[str, ...]]:
    """(base model, adapters) for the request's (string) `model` / `lora_adapters`.

    Raises UnknownModel naming what is unknown, and pydantic's ValidationError for a malformed
    `lora_adapters` (only composed requests pay for pydantic).
    """
    model = payload["model"]
    bases = gw.fleet.base_models()
    if model in bases:
        raw = payload.get("lora_adapters")
        refs = ADAPTER_REFS.validate_python(raw) if raw is not None else []
        adapters = tuple(dict.fromkeys(r.name for r in refs))
        missing = next((a for a in adapters if not gw.sync.known(a)), None)
        if missing is not None:
            raise UnknownModel(missing, "lora_adapters")
        return model, adapters
    if not gw.sync.known(model):
        raise UnknownModel(model)
    base = next(
        (r.inventory.model for r in gw.fleet.replicas.values() if r.inventory and model in r.residency()),
        None,
    )
    return (base if base is not None else (min(bases) if bases else "")), (model,)

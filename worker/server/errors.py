"""Engine exceptions to HTTP errors in OpenAI's envelope (vLLM's `type` names, `code` = status).

Bad input is never a 500: request and adapter errors map to 4xx here; only a real bug is a 500.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from lorafleet.protocol import ErrorResponse
from lorafleet.worker.engine.engine import RequestError
from lorafleet.worker.lora.adapter import AdapterError
from lorafleet.worker.lora.registry import AdapterConflict, AdapterNotFound
from lorafleet.worker.openai.protocol import UnsupportedField


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.reason = reason  # a stable code (adapter validation reasons), echoed as `error.reason`


def error_response(status: int, message: str, param: str | None = None, reason: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse.as_worker(status, message, param).model_dump()
    if reason is not None:
        body["error"]["reason"] = reason
    return JSONResponse(body, status_code=status, headers=headers)


def from_engine(exc: Exception) -> ApiError:
    """Map what `LLMEngine.add_request` / `load_adapter` raise; anything else is re-raised as a bug."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AdapterNotFound):
        return ApiError(404, str(exc), param="model", reason=exc.reason)
    if isinstance(exc, AdapterConflict):
        return ApiError(409, str(exc), reason=exc.reason)
    if isinstance(exc, AdapterError):
        return ApiError(400, str(exc), reason=exc.reason)
    if isinstance(exc, UnsupportedField):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, (RequestError, ValueError)):  # RequestError and sequence.SamplingError name their field
        return ApiError(400, str(exc), param=getattr(exc, "param", None))
    raise exc

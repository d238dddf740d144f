"""`POST /v1/responses`, OpenAI's Responses API: the request is read as a chat request
(worker/openai/responses_protocol.py), planned and run as chat runs (`plan_chat`), and its answer built
into output items and semantic stream events (worker/openai/response_writer.py). Streamed, the events go
out as named SSE events (`event: response.output_text.delta`), with no `[DONE]`, as OpenAI sends
them; an error after the first event is an `error` event. Nothing is stored: the routes on a stored
response (`GET`/`DELETE /v1/responses/{id}`, its `input_items` and `cancel`) are 404s saying so.

Errors name the Responses API's fields: a problem chat finds in `messages` is one in `input`, in
`max_completion_tokens` one in `max_output_tokens`, in `response_format` one in `text.format`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lorafleet.protocol import response_not_kept
from lorafleet.worker.engine.async_engine import RequestStream
from lorafleet.worker.openai import response_shapes as resp
from lorafleet.worker.openai.chat_answer import OFF, AnswerStream
from lorafleet.worker.openai.response_writer import ResponseWriter, new_id
from lorafleet.worker.openai.responses_protocol import ResponsesRequest
from lorafleet.worker.server.api import ChatPlan, Runtime, plan_chat, token_bytes_of, token_text_of
from lorafleet.worker.server.errors import ApiError, from_engine
from lorafleet.worker.server.runtime import WorkerRuntime
from lorafleet.worker.server.serving import collect, streaming_response, submit_all

log = logging.getLogger("lorafleet.worker.responses")
router = APIRouter()

# Chat's field names -> this API's, for errors (longest first: a prefix is renamed once).
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"), ("messages", "input"))


def _renamed(exc: ApiError) -> ApiError:
    param, message = exc.param, exc.message
    for chat, ours in _RENAMES:
        if param is not None and (param == chat or param.startswith(chat + ".")):
            param = ours + param[len(chat):]
        message = message.replace(chat, ours)
    return ApiError(exc.status, message, param, exc.reason)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, runtime: Runtime) -> Response:
    engine = runtime.require_engine()
    if body.previous_response_id is not None:
        raise ApiError(404, response_not_kept(body.previous_response_id), param="previous_response_id")
    try:
        chat = body.chat_request()
    except Exception as exc:  # noqa: BLE001 - mapped to 4xx; a bug re-raises
        raise from_engine(exc) from None
    try:
        plan = await plan_chat(runtime, chat)
    except ApiError as exc:  # what chat found, in this API's names
        raise _renamed(exc) from None
    try:
        streams = await submit_all(engine, [plan.ids], [plan.sampling], plan.adapters)
    except ApiError as exc:  # the engine's checks (the context length), in this API's names
        raise _renamed(exc) from None
    base = {"id": new_id("resp"), "created_at": resp.now(), "model": body.model or runtime.settings.model_name,
            **body.echo()}
    writer, reader = ResponseWriter(base, body.logprobs), AnswerStream(plan.start, plan.tool)
    logprobs = _logprobs(runtime, plan)
    reasoning_tokens = _reasoning_counter(runtime, plan)

    if body.stream:
        return streaming_response(_events(streams[0], writer, reader, logprobs, reasoning_tokens, len(plan.ids)))
    (r,) = await collect(request, streams)
    at = 0
    for i, (delta, n) in enumerate(zip(r.text or [""], r.step_logprobs or [0], strict=True)):  # as streamed
        writer.feed(*reader.feed(delta, i == max(len(r.text), 1) - 1), logprobs(r.logprobs[at:at + n]))
        at += n
    writer.finish(r.finish_reason, usage(len(plan.ids), r.generated, reasoning_tokens(r.token_ids, writer.has_reasoning)))
    return JSONResponse(writer.response())


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
@router.get("/v1/responses/{response_id}/input_items")
@router.post("/v1/responses/{response_id}/cancel")
async def stored_response(response_id: str) -> Response:
    """The routes on stored responses: none is stored, so each is a 404 saying so."""
    raise ApiError(404, response_not_kept(response_id), param="response_id")


async def _events(stream: RequestStream, writer: ResponseWriter, reader: AnswerStream,
                  logprobs: Callable[[list], list[dict] | None], reasoning_tokens: Callable[[list[int], bool], int],
                  prompt_tokens: int) -> AsyncIterator[str]:
    ids: list[int] = []
    try:
        for event in writer.start():
            yield _sse(event)
        async for out in stream:
            ids += out.new_token_ids
            for event in writer.feed(*reader.feed(out.text_delta, out.finished), logprobs(out.logprobs)):
                yield _sse(event)
            if out.finished:
                use = usage(prompt_tokens, out.num_generated, reasoning_tokens(ids, writer.has_reasoning))
                for event in writer.finish(out.finish_reason, use):
                    yield _sse(event)
    except Exception as exc:  # noqa: BLE001 - the events have begun: report in-band
        log.warning("response stream failed: %s", exc)
        try:
            api = from_engine(exc)
            code, message, param = str(api.status), api.message, api.param
        except Exception:  # noqa: BLE001
            code, message, param = "500", f"internal error: {type(exc).__name__}", None
        yield _sse(writer.event("error", code=code, message=message, param=param))
    finally:
        stream.cancel()


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, generated: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + generated}


def _logprobs(runtime: WorkerRuntime, plan: ChatPlan) -> Callable[[list], list[dict] | None]:
    """Chat's per-token logprob entries (token, logprob, bytes, top_logprobs), as output_text's."""
    if plan.k is None:
        return lambda lps: None
    text, raw = token_text_of(runtime), token_bytes_of(runtime)
    return lambda lps: resp.chat_logprobs(lps, text, raw)["content"]


def _reasoning_counter(runtime: WorkerRuntime, plan: ChatPlan) -> Callable[[list[int], bool], int]:
    """The answer's reasoning tokens from its token ids (and whether it had reasoning): from its
    start, or from the `<think>` it opened with (qwen3), up to and with the `</think>` token; to
    the end if it never closed its reasoning."""
    markers = runtime.reasoning_markers
    if plan.start is OFF or plan.start is False or markers is None:
        return lambda ids, thought: 0
    opening, closing = markers

    def count(ids: list[int], thought: bool) -> int:
        if plan.start is None and (not thought or opening not in ids):
            return 0
        begin = 0 if plan.start is True else ids.index(opening)
        end = ids.index(closing, begin) + 1 if closing in ids[begin:] else len(ids)
        return end - begin

    return count

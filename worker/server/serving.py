"""Run OpenAI completions and chat requests on the async engine: resolve the adapters, queue the
prompts, then either collect the outputs or stream them as SSE chunks ending in `[DONE]`.

Every path that stops early (client gone, error) cancels its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from lorafleet.protocol import LoraAdapterRef
from lorafleet.worker.engine.async_engine import AsyncEngine, RequestStream
from lorafleet.worker.engine.outputs import RequestOutput
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.openai.response_shapes import usage
from lorafleet.worker.sampling.sampler import TokenLogprobs
from lorafleet.worker.server.errors import ApiError, error_response, from_engine
from lorafleet.worker.server.event_stream import EventStreamResponse
from lorafleet.worker.server.settings import WorkerSettings

log = logging.getLogger("lorafleet.worker.server.serving")

DISCONNECT_POLL_S = 0.25


def resolve_adapters(model: str | None, lora_adapters: list[LoraAdapterRef] | None,
                     settings: WorkerSettings) -> tuple[tuple[str, float], ...]:
    """`model` names the base or one adapter; the RFC's `lora_adapters` composes several on the base.

    Unknown adapter names are found by the engine (404) when the request is queued.
    """
    base = settings.model_name
    limit = settings.engine.max_loras_per_request
    if lora_adapters is not None:
        if model not in (None, base):
            raise ApiError(400, f"with lora_adapters, model must name the base model {base!r}", param="model")
        if len(lora_adapters) > limit:
            raise ApiError(
                400, f"{len(lora_adapters)} adapters requested; this worker allows max_loras_per_request={limit}",
                param="lora_adapters",
            )
        return tuple((ref.name, ref.scale) for ref in lora_adapters)
    if model is None or model == base:
        return ()
    return ((model, 1.0),)


def default_max_tokens(max_model_len: int, prompt_len: int) -> int:
    return max(1, max_model_len - prompt_len)


@dataclass(slots=True)
class _Result:
    text: list[str] = field(default_factory=list)  # each step's delta
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    step_logprobs: list[int] = field(default_factory=list)  # how many of `logprobs` each step gave
    generated: int = 0
    finish_reason: str = "stop"
    prompt_logprobs: list[TokenLogprobs] | None = None  # SamplingParams.prompt_logprobs: prompt token i + 1's at i


async def submit_all(engine: AsyncEngine, prompts: list[str | list[int]], sampling: list[SamplingParams],
                     adapters: tuple[tuple[str, float], ...]) -> list[RequestStream]:
    """Queue every sequence of a request (prompts × choices) at once: their commands reach the engine
    thread together, so they start in the same step rather than one step apart. If one is refused
    (or the caller is cancelled), those already queued are cancelled."""
    tasks = [asyncio.ensure_future(engine.submit(p, sp, adapters)) for p, sp in zip(prompts, sampling, strict=True)]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for t in tasks:
            t.cancel()  # one still queueing aborts itself (`AsyncEngine.submit`)
        _cancel_queued(tasks)
        raise
    failed = next((t for t in tasks if t.cancelled() or t.exception() is not None), None)
    if failed is not None:
        _cancel_queued(tasks)
        try:
            failed.result()  # raises its error
        except Exception as exc:  # noqa: BLE001 - mapped to 4xx; a bug re-raises
            raise from_engine(exc) from None
    return [t.result() for t in tasks]


def _cancel_queued(tasks: list[asyncio.Future[RequestStream]]) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            t.result().cancel()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the prompt index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, exc))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_ = len(streams)
        while open_:
            i, item = await q.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(request: Request, streams: list[RequestStream]) -> list[_Result]:
    """Run to completion; a client that disconnects meanwhile cancels the requests."""
    results = [_Result() for _ in streams]

    async def run() -> None:
        async for i, out in _merged(streams):
            r = results[i]
            r.text.append(out.text_delta)
            r.token_ids.extend(out.new_token_ids)
            r.logprobs.extend(out.logprobs)
            r.step_logprobs.append(len(out.logprobs))
            r.generated = out.num_generated
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                r.finish_reason = out.finish_reason or "stop"

    task = asyncio.create_task(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return results
            if await request.is_disconnected():
                raise ApiError(499, "client disconnected")
    finally:
        task.cancel()
        for s in streams:
            s.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def streaming_response(events: AsyncIterator[str]) -> EventStreamResponse:
    return EventStreamResponse(events)


async def stream_events(
    streams: list[RequestStream],
    chunk: Callable[[int, RequestOutput], list[dict]],
    final: Callable[[dict[str, int]], dict] | None,
    prompt_tokens: int,
    first: list[dict] | None = None,
    continuous_usage: bool = False,
    generates: bool = True,
) -> AsyncIterator[str]:
    """SSE events: `first`, one or more chunks per output, a usage chunk if asked, then `[DONE]`.

    `prompt_tokens`: the request's, each prompt counted once however many choices it has (the
    last chunk's usage). `continuous_usage` (vLLM's `continuous_usage_stats` with `include_usage`):
    every chunk also carries its own choice's usage so far, as vLLM reports it (its prompt's tokens
    and that choice's completion tokens; `first`, the chat role chunks, have one prompt).
    `generates` False (completions' echo alone): the one token sampled is dropped, so none counts.
    Cancelled (client gone) or failed: the requests are aborted in `finally`.
    """
    generated = [0] * len(streams)
    try:
        for payload in first or ():
            if continuous_usage:
                payload["usage"] = usage(prompt_tokens, 0)
            yield sse(payload)
        async for i, out in _merged(streams):
            generated[i] = out.num_generated if generates else 0
            for payload in chunk(i, out):
                if continuous_usage:
                    payload["usage"] = usage(out.num_prompt_tokens, generated[i])
                yield sse(payload)
        if final is not None:
            yield sse(final(usage(prompt_tokens, sum(generated))))
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
        log.warning("stream failed: %s", exc)
        try:
            api = from_engine(exc)
            body = json.loads(error_response(api.status, api.message, api.param, api.reason).body)
        except Exception:  # noqa: BLE001
            body = json.loads(error_response(500, f"internal error: {type(exc).__name__}").body)
        yield sse(body)
        yield SSE_DONE
    finally:
        for s in streams:
            s.cancel()

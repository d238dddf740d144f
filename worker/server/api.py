"""Public routes: OpenAI completions and chat (streamed or not), `/v1/models`, probes, `/metrics`."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lorafleet.worker.engine.outputs import RequestOutput
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.openai import protocol as oai
from lorafleet.worker.openai import reasoning
from lorafleet.worker.openai import response_shapes as resp
from lorafleet.worker.openai.chat_answer import OFF, AnswerStream
from lorafleet.worker.openai.chat_answer import answer as chat_answer
from lorafleet.worker.openai.tools import ToolPlan
from lorafleet.worker.server.errors import ApiError, error_response, from_engine
from lorafleet.worker.server.metrics import take_snapshot
from lorafleet.worker.server.runtime import WorkerRuntime
from lorafleet.worker.server.serving import (
    collect,
    default_max_tokens,
    resolve_adapters,
    stream_events,
    streaming_response,
    submit_all,
)


async def get_runtime(request: Request) -> WorkerRuntime:
    """(async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request)"""
    return request.app.state.runtime


Runtime = Annotated[WorkerRuntime, Depends(get_runtime)]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16

probes = APIRouter()
router = APIRouter()
router.include_router(probes)


@probes.get("/health")
async def health(runtime: Runtime) -> Response:
    """Liveness: the process serves HTTP and the engine thread (once started) is alive."""
    if runtime.error is not None or (runtime.engine is not None and not runtime.engine.alive):
        return error_response(503, runtime.error or "the engine thread stopped")
    return JSONResponse({"status": "ok"})


@probes.get("/ready")
async def ready(runtime: Runtime) -> Response:
    """Readiness: the model and the start-up adapters are loaded."""
    if runtime.engine is None or not runtime.engine.alive:
        return error_response(503, runtime.error or "loading")
    return JSONResponse({"status": "ready", "model": runtime.settings.model_name})


@router.get("/metrics")
async def metrics(runtime: Runtime) -> Response:
    if runtime.engine is not None and runtime.engine.alive:
        engine = runtime.engine
        snap = await engine.call(take_snapshot, engine.engine)
        runtime.metrics.update(snap)
    runtime.metrics.update_fetch(runtime.fetcher.stats)
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(runtime: Runtime) -> dict[str, Any]:
    engine = runtime.require_engine()
    base = runtime.settings.model_name

    def listing() -> tuple[int, list[tuple[str, str]]]:
        e = engine.engine
        return e.max_model_len, [(n, e.registry.entries[n].path) for n in e.registry.names()]

    max_model_len, adapters = await engine.call(listing)
    created = resp.now()
    data = [{"id": base, "object": "model", "created": created, "owned_by": "lorafleet",
             "root": runtime.settings.model, "parent": None, "max_model_len": max_model_len}]
    data += [{"id": name, "object": "model", "created": created, "owned_by": "lorafleet", "root": path,
              "parent": base, "max_model_len": max_model_len} for name, path in adapters]
    return {"object": "list", "data": data}


def check_sequences(count: int, max_num_seqs: int) -> None:
    """One request's sequences (prompts x n) must fit in one running batch: more could never run
    together, and would queue ahead of every other client's requests."""
    if count > max_num_seqs:
        raise ApiError(400, f"prompts x n = {count} sequences, more than this worker runs at once "
                            f"(max_num_seqs {max_num_seqs}); send fewer prompts or a smaller n", param="n")


def _prepare_prompts(runtime: WorkerRuntime, prompts: list[str | list[int]]) -> list[list[int]]:
    """Tokenize here (the tokenizer is safe to share) so max_tokens can default to the room left.

    Called in a thread (`asyncio.to_thread`): a 1 MB prompt takes ~0.4 s to tokenize, which on the
    event loop stalled every other request's stream.
    """
    engine = runtime.require_engine().engine
    if len(prompts) > runtime.settings.max_request_prompts:
        raise ApiError(400, f"at most {runtime.settings.max_request_prompts} prompts per request", param="prompt")
    for p in prompts:  # all of them before tokenizing any
        if isinstance(p, str):
            engine.check_prompt_chars(len(p))
    out = []
    for p in prompts:
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)  # lengths checked above
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        out.append(ids)
    return out


def _prepare_chat(runtime: WorkerRuntime, body: oai.ChatCompletionRequest) -> list[int]:
    """The chat template applied and tokenized, in a thread like `_prepare_prompts`; messages too
    long to fit are refused before the template runs."""
    engine = runtime.require_engine().engine
    messages = body.template_messages()
    engine.check_prompt_chars(sum(len(m["content"]) for m in messages))
    ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                                       template_kwargs=body.template_kwargs())
    if not ids:
        raise ApiError(400, "the chat template made an empty prompt", param="messages")
    return ids


@router.post("/v1/completions")
async def completions(body: oai.CompletionRequest, request: Request, runtime: Runtime) -> Response:
    engine = runtime.require_engine()
    model = body.model or runtime.settings.model_name
    created, n = resp.now(), body.n
    try:
        body.check_supported()
        adapters = resolve_adapters(body.model, body.lora_adapters, runtime.settings)
        raw = body.prompts()
        check_sequences(len(raw) * n, engine.engine.config.max_num_seqs)  # before the tokenizing it spares
        prompts = await asyncio.to_thread(_prepare_prompts, runtime, raw)
        # OpenAI's (and vLLM's) default for the legacy completions endpoint is 16 tokens; echo
        # alone (max_tokens 0) samples one token and drops it, as vLLM does.
        echo_only = body.echo_only()
        max_tokens = 1 if echo_only else body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        choices = oai.per_choice(body.sampling(max_tokens, body.logprobs, body.prompt_k()), n)
    except Exception as exc:  # noqa: BLE001 - mapped to 4xx; a bug re-raises
        raise from_engine(exc) from None
    token_text, token_bytes = token_text_of(runtime), token_bytes_of(runtime)
    echo_texts: list[str] = []
    shown = [range(len(ids)) for ids in prompts]
    if body.echo or body.prompt_k() is not None:  # decoding off the event loop, as tokenizing is
        echo_texts, shown, token_text = await asyncio.to_thread(_prompt_texts, runtime, raw, prompts)
    if body.return_tokens_as_token_ids:
        token_text = resp.token_id_text
    # Choice i*n + j is prompt i's j-th choice (vLLM's order).
    streams = await submit_all(engine, [ids for ids in prompts for _ in range(n)], choices * len(prompts), adapters)
    rid = resp.new_id("cmpl")
    hidden = runtime.require_engine().engine.tokenizer.special_ids if body.skip_special_tokens else frozenset()
    offsets = [resp.TextOffsets(token_bytes, hidden, len(prompts[i // n]) if body.echo else 0, shown[i // n])
               for i in range(len(streams))]
    prompt_tokens = sum(map(len, prompts))  # once per prompt, whatever n is

    def finish(reason: str | None) -> str | None:
        """Echo alone ends at its 0 tokens, whatever the dropped token did."""
        return "length" if echo_only and reason is not None else reason

    def scored(i: int, out: Any, text: str, lps: list) -> tuple[str, list, list | None]:
        """A choice's text and logprobs with its prompt first (echo), and vLLM's prompt_logprobs;
        `out`: the choice's first output, or its whole result."""
        ids = prompts[i // n]
        if echo_only:
            text, lps = "", []
        if body.echo:  # the first prompt token's logprob is null: nothing predicts it
            text = echo_texts[i // n] + text
            lps = ([ids[0], *(out.prompt_logprobs or [])] if body.logprobs is not None else []) + lps
        vllm = None if body.prompt_logprobs is None else resp.vllm_prompt_logprobs(out.prompt_logprobs or [], token_text)
        return text, lps, vllm

    if body.stream:
        started = [False] * len(streams)

        def chunk(i: int, out: RequestOutput) -> list[dict]:
            text, lps, vllm = ("", [], None) if echo_only else (out.text_delta, list(out.logprobs), None)
            if not started[i]:  # echo and prompt logprobs come with a choice's first chunk
                started[i] = True
                text, lps, vllm = scored(i, out, text, lps)
            lp = resp.completion_logprobs(lps, token_text, offsets[i]) if body.logprobs is not None and lps else None
            if not text and not out.finished and lp is None and vllm is None:
                return []
            return [resp.completion_chunk(rid, created, model, i, text, finish(out.finish_reason), lp, vllm)]

        final = partial(resp.usage_chunk, rid, created, model, "text_completion") if body.include_usage else None
        return streaming_response(stream_events(streams, chunk, final, prompt_tokens,
                                                continuous_usage=body.continuous_usage, generates=not echo_only))

    results = await collect(request, streams)

    def choice(i: int, r) -> dict:
        text, lps, vllm = scored(i, r, "".join(r.text), r.logprobs)
        lp = resp.completion_logprobs(lps, token_text, offsets[i]) if body.logprobs is not None else None
        return resp.completion_choice(i, text, finish(r.finish_reason), lp, vllm)

    def choices() -> list[dict]:
        return [choice(i, r) for i, r in enumerate(results)]

    # A scored prompt is many entries to build: off the event loop.
    out = await asyncio.to_thread(choices) if body.prompt_k() is not None else choices()
    use = resp.usage(prompt_tokens, 0 if echo_only else sum(r.generated for r in results))
    return JSONResponse(resp.response("text_completion", rid, created, model, out, use))


@dataclasses.dataclass(frozen=True, slots=True)
class ChatPlan:
    """A chat request made ready to run: its prompt, sampling, tool plan and where its answer begins."""

    ids: list[int]
    sampling: SamplingParams
    tool: ToolPlan | None
    start: bool | None | object  # worker/openai/chat_answer.py (OFF: no reasoning parser)
    adapters: tuple[tuple[str, float], ...]
    k: int | None  # top logprobs per token; None: no logprobs


async def plan_chat(runtime: WorkerRuntime, body: oai.ChatCompletionRequest) -> ChatPlan:
    """Checks, the chat template and the sampling of a chat request (also what `/v1/responses`
    runs); 4xx ApiErrors for what the request gets wrong."""
    engine = runtime.require_engine()
    try:
        body.check_supported()
        adapters = resolve_adapters(body.model, body.lora_adapters, runtime.settings)
        check_sequences(body.n, engine.engine.config.max_num_seqs)
        ids = await asyncio.to_thread(_prepare_chat, runtime, body)
        k = body.logprobs_k()
        # vLLM's rule: max_completion_tokens (OpenAI's newer name) over max_tokens.
        max_tokens = body.max_completion_tokens or body.max_tokens
        parser = runtime.settings.tool_call_parser
        sampling = body.sampling(max_tokens or default_max_tokens(engine.engine.max_model_len, len(ids)), k,
                                 body.prompt_logprobs, parser)
        tool = body.tool_plan(parser)
        start, sampling = _reasoning_start(runtime, ids, sampling)
    except Exception as exc:  # noqa: BLE001 - mapped to 4xx; a bug re-raises
        raise from_engine(exc) from None
    return ChatPlan(ids, sampling, tool, start, adapters, k)


@router.post("/v1/chat/completions")
async def chat_completions(body: oai.ChatCompletionRequest, request: Request, runtime: Runtime) -> Response:
    engine = runtime.require_engine()
    model = body.model or runtime.settings.model_name
    created, n = resp.now(), body.n
    plan = await plan_chat(runtime, body)
    ids, tool, start, k = plan.ids, plan.tool, plan.start, plan.k
    streams = await submit_all(engine, [ids] * n, oai.per_choice(plan.sampling, n), plan.adapters)
    rid = resp.new_id("chatcmpl")
    token_text, token_bytes = token_text_of(runtime), token_bytes_of(runtime)
    if body.return_tokens_as_token_ids:
        token_text = resp.token_id_text
    echo = "" if tool is not None else body.echo_text()

    if body.stream:
        first = [resp.chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}, None) for i in range(n)]
        first += [resp.chat_chunk(rid, created, model, i, {"content": echo}, None) for i in range(n) if echo]
        readers = [AnswerStream(start, tool) for _ in range(n)]

        def chunk(i: int, out: RequestOutput) -> list[dict]:
            """The step's reasoning, content and tool-call pieces (a call's arguments as they are
            written), the logprobs with the first; the finish after them."""
            lp = resp.chat_logprobs(out.logprobs, token_text, token_bytes) if k is not None and out.logprobs else None
            thought, content, entries = readers[i].feed(out.text_delta, out.finished)
            parts = [{"reasoning": thought, "reasoning_content": thought}] if thought else []
            parts += [{"content": content}] if content or (lp is not None and not thought and not entries) else []
            parts += [{"tool_calls": entries}] if entries else []
            chunks = [resp.chat_chunk(rid, created, model, i, d, None, lp if j == 0 else None) for j, d in enumerate(parts)]
            if out.finished:
                chunks.append(resp.chat_chunk(rid, created, model, i, {}, readers[i].finish_reason(out.finish_reason)))
            return chunks

        final = partial(resp.usage_chunk, rid, created, model, "chat.completion.chunk") if body.include_usage else None
        return streaming_response(stream_events(streams, chunk, final, len(ids), first, body.continuous_usage))

    results = await collect(request, streams)

    def choice(i: int, r) -> dict:
        fields, content, calls, reason = chat_answer(start, tool, "".join(r.text), r.finish_reason)
        lp = resp.chat_logprobs(r.logprobs, token_text, token_bytes) if k is not None else None
        # vLLM's null content for an answer that was all reasoning (unless echo gave it some)
        no_content = content is None and not echo and (calls is not None or bool(fields))
        return resp.chat_choice(i, echo + (content or ""), reason, lp, calls, no_content, fields)

    out = [choice(i, r) for i, r in enumerate(results)]
    use = resp.usage(len(ids), sum(r.generated for r in results))
    extra = {}
    if body.prompt_logprobs is not None:  # vLLM's: once for the request, in its shape (completions' per choice)
        _, _, table = await asyncio.to_thread(_prompt_texts, runtime, [ids], [ids])
        extra["prompt_logprobs"] = await asyncio.to_thread(resp.vllm_prompt_logprobs, results[0].prompt_logprobs or [],
                                                           table)
    return JSONResponse(resp.response("chat.completion", rid, created, model, out, use, **extra))


def _reasoning_start(runtime: WorkerRuntime, ids: list[int], sampling: SamplingParams
                     ) -> tuple[bool | None | object, SamplingParams]:
    """Where the answer begins under the worker's --reasoning-parser (worker/openai/reasoning.py; OFF
    without one), and the sampling with a structured-output constraint held until the reasoning's
    end marker when the answer begins in its reasoning; an answer that might open one (qwen3, no
    marker in the prompt) is constrained from its first token, so it has none."""
    parser, markers = runtime.settings.reasoning_parser, runtime.reasoning_markers
    if parser is None or markers is None:
        return OFF, sampling
    tail = runtime.require_engine().engine.tokenizer.decode(ids[-8:], skip_special_tokens=False)
    start = reasoning.starts_in_reasoning(parser, tail)
    if sampling.constraint is None:
        return start, sampling
    if start:
        return start, dataclasses.replace(sampling, constraint_after=markers[1])
    return False, sampling


def _prompt_texts(runtime: WorkerRuntime, raw: list[str | list[int]], prompts: list[list[int]]
                  ) -> tuple[list[str], list[range], Callable[[int], str]]:
    """(each prompt as echo returns it: as sent, a token-id prompt decoded; which of its tokens that
    text shows: a string's own, not the special tokens the tokenizer put around them; every token's
    text, from a table of the vocabulary made once: a scored prompt's entries name prompt_len x k
    tokens, and the streamed first chunk that holds them is built on the event loop)."""
    engine = runtime.require_engine().engine
    tokenizer = engine.tokenizer
    texts = [p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False) for p, ids in zip(raw, prompts)]
    shown = [_own_tokens(tokenizer, p, ids) if isinstance(p, str) else range(len(ids)) for p, ids in zip(raw, prompts)]
    table = _vocabulary_texts(tokenizer, engine.model_config.vocab_size)
    return texts, shown, table.__getitem__


def _own_tokens(tokenizer, text: str, ids: list[int]) -> range:
    """Where `text`'s own tokens (tokenized adding no special tokens) lie in `ids` (tokenized adding
    them: a BOS first, an EOS last with some tokenizers); all of `ids` if they are not found whole."""
    own = tokenizer.encode(text, add_special_tokens=False)
    for lead in range(len(ids) - len(own) + 1):
        if ids[lead:lead + len(own)] == own:
            return range(lead, lead + len(own))
    return range(len(ids))


@functools.lru_cache(maxsize=2)
def _vocabulary_texts(tokenizer, vocab: int) -> tuple[str, ...]:
    """Each token id's text (as `token_text_of` decodes it), for one tokenizer: ~0.3 s once at a 100k vocabulary."""
    return tuple(tokenizer.decode([t], skip_special_tokens=False) for t in range(vocab))


def token_text_of(runtime: WorkerRuntime) -> Callable[[int], str]:
    tokenizer = runtime.require_engine().engine.tokenizer

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text


def token_bytes_of(runtime: WorkerRuntime) -> Callable[[int], bytes]:
    return runtime.require_engine().engine.tokenizer.token_bytes

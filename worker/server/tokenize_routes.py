"""vLLM's tokenizer routes: `POST /tokenize` (a prompt, or chat messages through the chat template)
and `POST /detokenize` (token ids back to text), with vLLM's fields and answers, so a client can
count a prompt's tokens against `max_model_len` before sending it.

Adapters do not change the tokenizer here, so `model` (the base or any adapter this worker holds;
else 404, as the generating routes) only has to exist. Tokenizing runs in a thread, as for
completions: a long prompt takes a while, and the event loop serves everyone else meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import Field

from lorafleet.protocol import JsonBody
from lorafleet.worker.openai.protocol import ChatMessage, TemplateKwargs
from lorafleet.worker.server.api import Runtime
from lorafleet.worker.server.errors import ApiError, from_engine
from lorafleet.worker.server.runtime import WorkerRuntime

router = APIRouter()


class TokenizeRequest(JsonBody):
    """vLLM's two shapes in one: `prompt` (completions) or `messages` (chat), exactly one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # with messages: passed to the chat template, as chat does
    chat_template_kwargs: TemplateKwargs = None
    return_token_strs: bool = False


class DetokenizeRequest(JsonBody):
    model: str | None = None
    tokens: list[int]


async def _check_model(runtime: WorkerRuntime, model: str | None) -> None:
    if model is None or model == runtime.settings.model_name:
        return
    engine = runtime.require_engine()
    if not await engine.call(lambda: model in engine.engine.registry.names()):
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, runtime: Runtime) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt" if body.prompt is None else "messages")
    await _check_model(runtime, body.model)
    engine = runtime.require_engine().engine
    tokenizer = engine.tokenizer

    def run() -> tuple[list[int], list[str] | None]:
        if body.messages is not None:  # the ids the chat route feeds the model
            messages = [m.for_template() for m in body.messages]
            engine.check_prompt_chars(sum(len(m["content"]) for m in messages))
            ids = tokenizer.encode_chat(messages, body.add_generation_prompt, body.tools,
                                        add_special_tokens=bool(body.add_special_tokens),
                                        template_kwargs=body.chat_template_kwargs)
        else:
            engine.check_prompt_chars(len(body.prompt))
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return ids, [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None

    try:
        ids, strs = await asyncio.to_thread(run)
    except Exception as exc:  # noqa: BLE001 - too long, not valid Unicode, a template error: 400
        raise from_engine(exc) from None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, runtime: Runtime) -> dict[str, str]:
    await _check_model(runtime, body.model)
    engine = runtime.require_engine().engine
    vocab = engine.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}

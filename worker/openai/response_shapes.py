"""OpenAI's response shapes as the worker sends them: ids, usage, completions' and chat's choices,
stream chunks, and the logprobs of each (legacy completions' parallel lists, chat's per-token
entries, vLLM's prompt_logprobs). The requests are worker/openai/protocol.py."""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Callable, Container
from typing import Any

from lorafleet.worker.sampling.sampler import TokenLogprobs


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
    """Where each token starts in a choice's text, in characters, its echoed prompt's tokens and
    then its generated ones (kept across stream chunks). Counted over the tokens' bytes: a token
    holding part of a character has no text of its own (its decoded text is U+FFFD), so each
    character counts once, and a token starts at the character holding its first byte. A token the
    text leaves out has no width, starting where the next one does: a generated special token when
    the text skips them (`hidden`), an echoed prompt token outside `prompt_shown` (the BOS the
    tokenizer put before a string prompt, which echo returns as sent)."""

    def __init__(self, token_bytes: Callable[[int], bytes], hidden: Container[int] = frozenset(),
                 prompt_tokens: int = 0, prompt_shown: range = range(0)) -> None:
        self._token_bytes = token_bytes
        self._hidden, self._prompt_tokens, self._prompt_shown = hidden, prompt_tokens, prompt_shown
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0
        self._tokens = 0

    def next(self, token_id: int) -> int:
        start, i = self._chars, self._tokens
        self._tokens += 1
        if i not in self._prompt_shown if i < self._prompt_tokens else token_id in self._hidden:
            return start
        self._chars += len(self._utf8.decode(self._token_bytes(token_id)))
        return start


def token_id_text(token_id: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` names it in logprobs: its id, not its text (which
    may not be valid UTF-8 on its own). Its `bytes` in chat stay the token's own."""
    return f"token_id:{token_id}"


def completion_logprobs(lps: list[TokenLogprobs | int], token_text: Callable[[int], str],
                        offsets: TextOffsets) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: parallel lists per token. As OpenAI (and vLLM) do, each
    `top_logprobs` entry also holds the token itself, so it has up to `logprobs` + 1 entries
    (`logprobs: 0`: the token alone); tokens with the same text share one key. A bare token id (an
    echoed prompt's first token, which nothing predicts) has null logprobs."""
    ids = [lp if isinstance(lp, int) else lp.token_id for lp in lps]
    tokens = [token_text(t) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None if isinstance(lp, int) else lp.logprob for lp in lps],
        "top_logprobs": [None if isinstance(lp, int) else {**{token_text(t): v for t, v in lp.top}, text: lp.logprob}
                         for lp, text in zip(lps, tokens)],
        "text_offset": [offsets.next(t) for t in ids],
    }


def vllm_prompt_logprobs(lps: list[TokenLogprobs], token_text: Callable[[int], str]) -> list[Any]:
    """vLLM's `prompt_logprobs` of a choice: null for the first prompt token (nothing predicts it),
    then for each token a map from token id to {logprob, rank, decoded_token}: the token itself
    and the top k."""
    out: list[Any] = [None]
    for lp in lps:
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": token_text(t)} for r, (t, v) in enumerate(lp.top, 1)}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text(lp.token_id)}
        out.append(entry)
    return out


def chat_logprobs(lps: list[TokenLogprobs], token_text: Callable[[int], str],
                  token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token_id), "logprob": logprob, "bytes": list(token_bytes(token_id))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


def response(obj: str, rid: str, created: int, model: str, choices: list[dict], use: dict,
             **extra: Any) -> dict[str, Any]:
    """A whole (not streamed) answer: `obj` is "text_completion" or "chat.completion"; `extra`:
    top-level fields (chat's `prompt_logprobs`)."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": use, **extra}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      prompt_logprobs: list | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [completion_choice(index, text, finish_reason, logprobs, prompt_logprobs)],
    }


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None,
                tool_calls: list[dict[str, Any]] | None = None, no_content: bool = False,
                reasoning: dict[str, Any] | None = None) -> dict[str, Any]:
    """With `tool_calls` the message holds them, and its content is null unless text came before
    them (OpenAI's shape); `no_content`: null content. `reasoning`: the message's reasoning fields
    (worker/openai/chat_answer.py)."""
    message: dict[str, Any] = {"role": "assistant", "content": None if no_content else text, **(reasoning or {})}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}

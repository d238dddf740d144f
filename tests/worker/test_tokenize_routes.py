"""vLLM's `/tokenize` and `/detokenize` on the served worker, against transformers' tokenizer for the
same model folder (the oracle), and the ids the generating routes use (usage.prompt_tokens)."""

from __future__ import annotations

import httpx
import pytest

from tests.worker.test_api_openai_compat import post, refused
from tests.worker.worker_harness import CHAT, PROMPT


@pytest.fixture(scope="module")
def hf(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model))


def call(worker, route: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):  # JSON that httpx would not write
        return httpx.post(f"{worker.url}/{route}", content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(f"{worker.url}/{route}", json=body, timeout=60)


def test_a_prompt_is_transformers_ids_and_what_completions_count(worker, hf):
    """transformers' AutoTokenizer's ids: the demo folder's `add_bos_token: true` adds no BOS, since its
    tokenizer.json has no post-processor (transformers 5 and vLLM read special tokens from there)."""
    r = call(worker, "tokenize", {"model": "sql", "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == hf(PROMPT)["input_ids"] == hf(PROMPT, add_special_tokens=False)["input_ids"]
    assert got["count"] == len(got["tokens"])
    assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == worker.engine.max_model_len
    done = post(worker, "completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    bare = call(worker, "tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf(PROMPT, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_messages_are_the_chat_routes_ids(worker, hf, generation_prompt):
    body = {"model": "demo", "messages": CHAT, "add_generation_prompt": generation_prompt}
    got = call(worker, "tokenize", body).json()
    want = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=generation_prompt)
    assert got["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    chat = post(worker, "chat/completions", {**body, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == got["count"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = {**body, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    chat = post(worker, "chat/completions", {**with_tools, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == call(worker, "tokenize", with_tools).json()["count"]


def test_detokenize_is_transformers_decode(worker, hf):
    ids = hf(PROMPT)["input_ids"]
    r = call(worker, "detokenize", {"model": "poem", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("route,body,param", [
    ("tokenize", {"prompt": PROMPT, "messages": CHAT}, "messages"),
    ("tokenize", {"model": "demo"}, "prompt"),
    ("tokenize", {"messages": []}, None),
    ("tokenize", b'{"prompt": "a\\ud800"}', None),  # a lone surrogate: not valid Unicode
    ("detokenize", {"tokens": [0, -1]}, "tokens"),
    ("detokenize", {"tokens": [10**9]}, "tokens"),
    ("detokenize", {"tokens": "abc"}, None),
])
def test_bad_input_is_a_400(worker, route, body, param):
    r = call(worker, route, body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("route,body", [("tokenize", {"prompt": "x"}), ("detokenize", {"tokens": [1]})])
def test_an_unknown_model_is_a_404(worker, route, body):
    r = call(worker, route, {"model": "nope", **body})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_too_long_a_prompt_is_refused(worker):
    """As completions refuses it: before tokenizing what could never fit the context."""
    msg = refused(call(worker, "tokenize", {"prompt": "x" * (worker.engine.max_prompt_chars + 1)}), None)
    assert "characters can fit this model's context" in msg

"""Reasoning split out of chat answers (worker/openai/reasoning.py, --reasoning-parser): the split of known
texts, the same streamed in pieces of every size as read whole; served, through the official
client, the message's `reasoning` (and `reasoning_content`) and content, structured outputs and
tool calls held until the reasoning ends, `chat_template_kwargs` reaching the template."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import httpx
import openai
import pytest

from lorafleet.worker.openai.reasoning import ReasoningStream, split, starts_in_reasoning
from tests.worker.test_api_openai_compat import post, refused
from tests.worker.worker_harness import CHAT, RunningWorker, worker_settings


def streamed(start, text: str, cut: int) -> tuple[str | None, str | None]:
    stream, thought, content = ReasoningStream(start), "", ""
    for out in [stream.feed(text[i : i + cut]) for i in range(0, len(text), cut)] + [stream.finish()]:
        thought, content = thought + out[0], content + out[1]
    return thought or None, content or None


@pytest.mark.parametrize("start,text,want", [
    (True, "<think>the sum is 4</think>Four.", ("the sum is 4", "Four.")),
    (True, "the sum is 4</think>\n\nFour.", ("the sum is 4", "\n\nFour.")),  # the template opened it
    (True, "thinking, cut short", ("thinking, cut short", None)),  # deepseek_r1: never closed: all reasoning
    (True, "</think>Four.", (None, "Four.")),
    (True, "a </thin b</think>c", ("a </thin b", "c")),  # a partial marker is text
    (None, "<think>x</think>y", ("x", "y")),  # qwen3: the answer opens its reasoning
    (None, " \n<think>x", ("x", None)),
    (None, "just an answer", (None, "just an answer")),
    (None, "<thin", (None, "<thin")),
    (None, "", (None, None)),
    (False, "<think>x</think>y", (None, "<think>x</think>y")),  # the prompt closed it: all content
])
def test_the_split_streamed_and_whole(start, text, want):
    assert split(start, text) == want
    for cut in (1, 2, 3, 5, 8, len(text) or 1):
        assert streamed(start, text, cut) == want, cut


def test_nothing_that_could_be_a_marker_is_sent_early():
    stream = ReasoningStream(True)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>one two </th") == ("one two ", "")
    assert stream.feed("ink>An") == ("", "An")
    assert stream.feed("swer") == ("", "swer")


@pytest.mark.parametrize("parser,tail,want", [
    ("deepseek_r1", "<|assistant|>\n", True), ("deepseek_r1", "<|assistant|><think>\n", True),
    ("deepseek_r1", "<think>\n\n</think>\n\n", False), ("qwen3", "<|assistant|>\n", None),
    ("qwen3", "<|assistant|>\n<think>\n", True), ("qwen3", "<think>\n\n</think>\n\n", False),
])
def test_where_the_answer_begins(parser, tail, want):
    assert starts_in_reasoning(parser, tail) is want


# -- served ------------------------------------------------------------------------------------------------

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_model(demo_model, tmp_path_factory):
    return make_thinking_model(demo_model, tmp_path_factory.mktemp("thinking") / "model")


def make_thinking_model(demo_model, out):
    """The demo model, copied to `out`, with `<think>` and `</think>` tokens (two of its unused
    special tokens renamed, plain added tokens, as Qwen3's are) and a template that opens the
    reasoning with `enable_thinking`."""
    shutil.copytree(demo_model, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    renamed = {"<pad>": "<think>", "<|system|>": "</think>"}
    for added in tok["added_tokens"]:
        if added["content"] in renamed:
            added.update(content=renamed[added["content"]], special=False)
    tok["model"]["vocab"] = {renamed.get(k, k): v for k, v in tok["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    config["chat_template"] = THINKING_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def reasoning_worker(model, adapters, parser: str, tool_parser: str | None = None, **kw):
    settings = dataclasses.replace(worker_settings(model, adapters, **kw), reasoning_parser=parser,
                                   tool_call_parser=tool_parser)
    w = RunningWorker(settings)
    yield w.start()
    w.stop()


@pytest.fixture(scope="module")
def r1_worker(thinking_model, demo_adapters):
    yield from reasoning_worker(thinking_model, demo_adapters, "deepseek_r1", "hermes")


@pytest.fixture(scope="module")
def qwen3_worker(thinking_model, demo_adapters):
    yield from reasoning_worker(thinking_model, demo_adapters, "qwen3")


def token(worker, text: str) -> int:
    (t,) = worker.engine.tokenizer.encode(text, add_special_tokens=False)
    return t


def openai_client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)


def streamed_message(worker, **kw) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) put together from a stream's deltas (fields the client
    keeps as extras)."""
    thought = content = ""
    reason = None
    for c in openai_client(worker).chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            extra = ch.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            thought += extra.get("reasoning") or ""
            content += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return thought, content, reason


def test_an_answer_that_never_ends_its_reasoning_is_all_reasoning(r1_worker):
    """deepseek_r1: answers begin in their reasoning; the demo model, pushed to one token, never
    writes `</think>`: the whole text is the reasoning, content null; streamed, the same."""
    kw = dict(model="demo", messages=CHAT, max_tokens=4, temperature=0,
              logit_bias={str(token(r1_worker, "The")): 100})
    r = openai_client(r1_worker).chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.content is None and message.model_extra["reasoning"] == "The" * 4
    assert message.model_extra["reasoning_content"] == "The" * 4
    assert streamed_message(r1_worker, **kw) == ("The" * 4, "", "length")


def test_echo_keeps_its_content_when_the_answer_is_all_reasoning(r1_worker):
    messages = [*CHAT, {"role": "assistant", "content": "Let me see"}]
    body = {"model": "demo", "messages": messages, "max_tokens": 2, "temperature": 0, "echo": True,
            "add_generation_prompt": False, "logit_bias": {str(token(r1_worker, "The")): 100}}
    message = post(r1_worker, "chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == "Let me see" and message["reasoning"] == "The" * 2

def test_structured_outputs_hold_after_the_reasoning(r1_worker):
    """A guided_choice answer in deepseek_r1: the model writes `</think>` first (a logit_bias;
    the choice does not allow it, so only an unconstrained reasoning can write it), then one of the
    choices: the reasoning empty, the content the choice. Were the grammar to hold from the first
    token, there would be no `</think>`, and all of it would be reasoning."""
    body = {"model": "demo", "messages": CHAT, "max_tokens": 16, "temperature": 0,
            "logit_bias": {str(token(r1_worker, "</think>")): 100}, "guided_choice": ["Paris", "Oslo"]}
    r = post(r1_worker, "chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning"] is None and choice["message"]["content"] in ("Paris", "Oslo")
    assert choice["finish_reason"] == "stop"


def test_tool_calls_are_read_after_the_reasoning(r1_worker):
    """deepseek_r1 with hermes: the reasoning ends, then a call (a regex holds the text after the
    reasoning to it): the call comes back as tool_calls, not as reasoning."""
    from tests.worker.test_tools import HERMES_CALL, WEATHER, _regex

    body = {"model": "demo", "messages": CHAT, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "logit_bias": {str(token(r1_worker, "</think>")): 100}, "guided_regex": _regex(HERMES_CALL)}
    choice = post(r1_worker, "chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris", "unit": "C"}


def test_qwen3_reasons_only_where_the_answer_or_the_prompt_opens_it(qwen3_worker):
    """qwen3: a plain answer is content; with `chat_template_kwargs: {"enable_thinking": true}` the
    template ends the prompt with `<think>`, so the same greedy answer is reasoning."""
    kw = dict(model="demo", messages=CHAT, max_tokens=6, temperature=0)
    plain = openai_client(qwen3_worker).chat.completions.create(**kw).choices[0].message
    assert plain.content and plain.model_extra["reasoning"] is None
    thinking = openai_client(qwen3_worker).chat.completions.create(
        **kw, extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert thinking.content is None and thinking.model_extra["reasoning"]
    tok = qwen3_worker.engine.tokenizer
    ids = httpx.post(f"{qwen3_worker.url}/tokenize", json={
        "model": "demo", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
    assert tok.decode(ids, skip_special_tokens=False).endswith("<think>\n")


@pytest.mark.parametrize("key", ["messages", "self", "namespace"])
def test_template_variables_of_the_server_cannot_be_set(qwen3_worker, key):
    """The server's own variables, render's argument and jinja's globals (which templates call)."""
    body = {"model": "demo", "messages": CHAT, "chat_template_kwargs": {key: 1}}
    assert "the server sets them" in refused(post(qwen3_worker, "chat/completions", body), "chat_template_kwargs")
    r = httpx.post(f"{qwen3_worker.url}/tokenize", json={"messages": CHAT, "chat_template_kwargs": {key: 1}})
    assert r.status_code == 400, r.text


def test_what_a_variable_makes_the_template_do_is_a_400(thinking_model):
    from lorafleet.worker.engine.tokenizer import Tokenizer

    tok = Tokenizer(thinking_model)
    tok.chat_template = "{{ depth + 1 }}{{ messages[0]['content'] }}"
    assert tok.apply_chat_template(CHAT, template_kwargs={"depth": 1}).startswith("2")
    for bad in ("deep", None):
        with pytest.raises(ValueError, match="chat template failed: TypeError"):
            tok.apply_chat_template(CHAT, template_kwargs={"depth": bad})


def test_a_model_without_the_markers_does_not_start(demo_model, demo_adapters, monkeypatch, caplog):
    """It fails before the weights load (the engine is never built), saying why in the log (the
    error clients see names the error's type only: docs/hardening.md)."""
    from lorafleet.worker.engine import engine
    from lorafleet.worker.server.runtime import WorkerRuntime

    def not_built(*args, **kw):
        raise AssertionError("the engine was built before the markers were checked")

    monkeypatch.setattr(engine, "LLMEngine", not_built)
    settings = dataclasses.replace(worker_settings(demo_model, demo_adapters), reasoning_parser="qwen3")
    runtime = WorkerRuntime.create(settings)
    with caplog.at_level("ERROR", logger="lorafleet.worker"):
        asyncio.run(runtime._load())
    assert runtime.engine is None and "ValueError" in runtime.error
    assert "--reasoning-parser qwen3" in caplog.text and "</think>" in caplog.text


def test_without_a_parser_there_is_no_reasoning_field(worker):
    message = post(worker, "chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 2}).json()[
        "choices"][0]["message"]
    assert set(message) == {"role", "content"}

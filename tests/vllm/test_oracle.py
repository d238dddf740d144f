"""vLLM as the oracle of our worker: the same tiny random Llama (fp32, head_dim 32) and PEFT adapters of
different ranks and target modules, served by both; the same prompt token ids (and transformers'
AutoTokenizer's), top-5 first-step logprobs by token id to 2e-3, and equal greedy text."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.server.settings import WorkerSettings
from tests.vllm.assets import MAX_LORA_RANK, ORACLE_ADAPTERS
from tests.vllm.vllm_server import skip_reason, vllm_python
from tests.worker.worker_harness import RunningWorker

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm,
              pytest.mark.skipif(vllm_python() is None, reason=skip_reason())]

PROMPTS = ["The router sends each request to", "SELECT name, score FROM students WHERE"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
ADAPTERS = [None, *(a.name for a in ORACLE_ADAPTERS)]
TOL = 2e-3


@pytest.fixture(scope="module")
def ours(vllm_assets, adapter_dirs, served_name) -> Iterator[RunningWorker]:
    settings = WorkerSettings(
        model=str(vllm_assets / "model"), served_model_name=served_name,
        lora_modules=tuple((n, str(p)) for n, p in adapter_dirs.items()),
        engine=EngineConfig(max_loras=4, max_cpu_loras=8, max_lora_rank=MAX_LORA_RANK, num_kv_blocks=256,
                            dtype="float32"),
        freeze_gc=False,
    )
    w = RunningWorker(settings).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def theirs(vllm_server, adapter_dirs):
    for name, path in adapter_dirs.items():
        r = vllm_server.load(name, path)
        assert r.status_code == 200 or "already" in r.text, r.text
    assert set(adapter_dirs) <= set(vllm_server.models())
    return vllm_server


def post(url: str, route: str, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(f"{url}/{route}", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_token_ids_are_vllms_and_transformers(ours, theirs, vllm_assets, served_name):
    """The BOS case: tokenizer_config.json says add_bos_token, tokenizer.json has no post-processor."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(vllm_assets / "model"))
    for prompt in PROMPTS:
        body = {"model": served_name, "prompt": prompt}
        want = hf(prompt)["input_ids"]
        assert post(theirs.url, "tokenize", body, theirs.headers())["tokens"] == want
        assert post(ours.url, "tokenize", body)["tokens"] == want
    chat = {"model": served_name, "messages": CHAT, "add_generation_prompt": True}
    want = list(hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert post(theirs.url, "tokenize", chat, theirs.headers())["tokens"] == want
    assert post(ours.url, "tokenize", chat)["tokens"] == want


def first_step(url: str, headers: dict, model: str, prompt: str) -> tuple[dict[int, float], int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
            "return_tokens_as_token_ids": True}
    out = post(url, "v1/completions", body, headers)
    top = out["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.removeprefix("token_id:")): v for k, v in top.items()}, out["usage"]["prompt_tokens"]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[a or "base" for a in ADAPTERS])
def test_first_step_logprobs_match_vllm(ours, theirs, served_name, adapter):
    model = adapter or served_name
    for prompt in PROMPTS:
        got, got_n = first_step(ours.url, {}, model, prompt)
        want, want_n = first_step(theirs.url, theirs.headers(), model, prompt)
        assert got_n == want_n
        assert set(got) == set(want), (got, want)
        worst = max(abs(got[t] - want[t]) for t in want)
        assert worst <= TOL, (adapter, prompt, got, want)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[a or "base" for a in ADAPTERS])
def test_greedy_text_matches_vllm(ours, theirs, served_name, adapter):
    model = adapter or served_name
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        got = post(ours.url, "v1/completions", body)["choices"][0]
        want = post(theirs.url, "v1/completions", body, theirs.headers())["choices"][0]
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["text"] == want["text"]  # an answer cut inside a character ends before it in both
    chat = {"model": model, "messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = post(ours.url, "v1/chat/completions", chat)
    want = post(theirs.url, "v1/chat/completions", chat, theirs.headers())
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    got_text, want_text = got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]
    assert got_text == want_text
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"


def test_every_vllm_request_field_is_implemented_or_refused(theirs):
    """vLLM's own request models, read from its virtualenv: each field is one of ours, or in the
    table of fields we refuse at a value that changes the output (never silently ignored)."""
    import json
    import subprocess

    from lorafleet.worker.openai import protocol as oai

    script = ("import json\n"
              "from vllm.entrypoints.openai.completion.protocol import CompletionRequest as C\n"
              "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as H\n"
              "print(json.dumps({'completions': list(C.model_fields), 'chat': list(H.model_fields)}))\n")
    out = subprocess.run([theirs.argv[0], "-c", script], capture_output=True, text=True, timeout=300, check=True)
    fields = json.loads(out.stdout.strip().splitlines()[-1])
    for route, ours_cls in (("completions", oai.CompletionRequest), ("chat", oai.ChatCompletionRequest)):
        known = set(ours_cls.model_fields) | set(oai.UNSUPPORTED) | set(ours_cls.unsupported_here())
        assert set(fields[route]) - known == set(), route


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_an_answer_cut_inside_a_character_ends_before_it_as_in_vllm(ours, theirs, served_name, vllm_assets,
                                                                    max_tokens):
    """logit_bias forces the first byte token of "é" at every step, so max_tokens cuts the answer
    inside a character: both texts leave the partial character out (vLLM's DecodeStream emits none)."""
    from lorafleet.worker.engine.tokenizer import Tokenizer

    tok = Tokenizer(vllm_assets / "model")
    lead = tok.encode("é", add_special_tokens=False)[0]
    assert tok.decode([lead]) == "\ufffd"  # a byte token: part of a character
    body = {"model": served_name, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(lead): 100}, "logprobs": 0, "return_tokens_as_token_ids": True}
    got = post(ours.url, "v1/completions", body)["choices"][0]
    want = post(theirs.url, "v1/completions", body, theirs.headers())["choices"][0]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"] == [f"token_id:{lead}"] * max_tokens
    assert got["text"] == want["text"]
    assert "\ufffd" not in got["text"]

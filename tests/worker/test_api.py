"""The public OpenAI API on a real uvicorn server, driven by the official `openai` client; greedy
output must equal the engine's offline `generate`."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.worker_harness import TOKEN, RunningWorker, auth, wait_for, worker_settings

MAX_TOKENS = 12
PROMPT = "The router sends each request to"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]

TARGETS = {  # id -> (model field, lora_adapters body field, engine adapters)
    "base": ("demo", None, ()),
    "sql": ("sql", None, (("sql", 1.0),)),
    "chat": ("chat", None, (("chat", 1.0),)),
    "poem": ("poem", None, (("poem", 1.0),)),
    "code": ("code", None, (("code", 1.0),)),
    "legal": ("legal", None, (("legal", 1.0),)),
    "composed": ("demo", [{"name": "sql", "scale": 0.7}, {"name": "poem", "scale": 0.5}],
                 (("sql", 0.7), ("poem", 0.5))),
}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters, token_file):
    w = RunningWorker(worker_settings(demo_model, demo_adapters, token_file=token_file)).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def offline(demo_model, demo_adapters, worker):
    """A second engine with the same settings, run offline (no server)."""
    s = worker.runtime.settings
    return LLMEngine(demo_model, s.engine, lora_modules={n: str(p) for n, p in demo_adapters.items()})


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


def expected(offline: LLMEngine, prompt, adapters) -> str:
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return offline.generate([prompt], sp, [adapters])[0].text


def _extra(lora_adapters):
    return {"lora_adapters": lora_adapters} if lora_adapters else None


# -- happy paths ------------------------------------------------------------------------------------


def test_health_and_ready(worker):
    assert httpx.get(f"{worker.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{worker.url}/ready").json()["status"] == "ready"


def test_models_lists_base_and_adapters_with_parent(client, demo_adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"demo", *demo_adapters}
    assert models["demo"].model_extra["parent"] is None
    for name in demo_adapters:
        assert models[name].model_extra["parent"] == "demo"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_completions_match_offline(client, offline, target, stream):
    model, lora, adapters = TARGETS[target]
    want = expected(offline, PROMPT, adapters)
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=_extra(lora))
    if not stream:
        r = client.completions.create(**kwargs)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
        assert r.model == model
        return
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == (
        chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_chat_matches_offline(client, offline, target, stream):
    model, lora, adapters = TARGETS[target]
    want = expected(offline, offline.tokenizer.encode_chat(MESSAGES), adapters)
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body=_extra(lora))
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want
        return
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_prompt_as_token_ids_and_several_prompts(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    r = client.completions.create(model="sql", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected(offline, ids, (("sql", 1.0),))
    r = client.completions.create(model="demo", prompt=[PROMPT, "Roses are red"], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].text == expected(offline, "Roses are red", ())


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert all(c.choices for c in chunks)


def test_logprobs(client, offline):
    r = client.completions.create(model="chat", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 3 for t in lp.top_logprobs)
    c = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    # Greedy: the chosen token is the most likely one.
    assert all(e.logprob >= e.top_logprobs[0].logprob - 1e-5 for e in content)


SPLIT_TEXT = "✓ café, wörld ☃"  # byte-level BPE splits these characters over several tokens


def forcing(tokens: list[int]):
    """A logits hook under which greedy decoding emits `tokens`, one per step."""

    def hook(seqs, logits):
        for row, seq in enumerate(seqs):
            if len(seq.output_ids) < len(tokens):
                logits[row] = -20.0
                logits[row, tokens[len(seq.output_ids)]] = 20.0

    return hook


def test_logprobs_bytes_are_each_tokens_own_bytes(worker, offline):
    """A token holding part of a character: chat's `bytes` are that part (they were U+FFFD's
    239, 191, 189), so a response's bytes add up to its content; completions' `text_offset`
    counts each character once, at the token holding its first byte, streamed or not."""
    tok = offline.tokenizer
    forced = tok.encode(SPLIT_TEXT, add_special_tokens=False)
    assert sum(tok.decode([t]) == "\ufffd" for t in forced) >= 4
    common = {"model": "demo", "max_tokens": len(forced), "temperature": 0, "ignore_eos": True}
    worker.engine.logits_hook = forcing(forced)
    try:
        chat = httpx.post(f"{worker.url}/v1/chat/completions", timeout=30, json={
            **common, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}).json()
        plain = httpx.post(f"{worker.url}/v1/completions", timeout=30, json={**common, "prompt": PROMPT, "logprobs": 1})
        with httpx.stream("POST", f"{worker.url}/v1/completions", timeout=30,
                          json={**common, "prompt": PROMPT, "logprobs": 1, "stream": True}) as r:
            events = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
    finally:
        worker.engine.logits_hook = None

    assert chat["choices"][0]["message"]["content"] == SPLIT_TEXT
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(forced)
    assert b"".join(bytes(e["bytes"]) for e in content) == SPLIT_TEXT.encode()
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)  # greedy: the chosen one is first

    choice = plain.json()["choices"][0]
    assert choice["text"] == SPLIT_TEXT
    raw = SPLIT_TEXT.encode()
    starts = [sum(len(bytes(e["bytes"])) for e in content[:i]) for i in range(len(content))]
    want = [len(raw[:b].decode("utf-8", errors="ignore")) for b in starts]  # the character holding byte b
    assert choice["logprobs"]["text_offset"] == want
    streamed = [o for e in events for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == want


@pytest.mark.parametrize("skip_special", [True, False])
def test_text_offsets_index_the_echoed_text(worker, offline, skip_special):
    """Echo with logprobs: `text_offset` indexes the choice's text, prompt and completion. A BOS
    sent as the prompt's first token id is in the echoed text (decoded with special tokens) at 0;
    a generated special token is in the text only with skip_special_tokens off. The oracle: the
    tokenizer's own decode of each token's prefix; streamed, the same offsets."""
    tok = offline.tokenizer
    ids = [tok.bos_id, *tok.encode(PROMPT)]
    assert tok.bos_id in tok.special_ids and tok.bos_id not in tok.encode(PROMPT)
    pad = tok.token_id("<pad>")
    forced = [*tok.encode(" and then", add_special_tokens=False), pad, *tok.encode(" more", add_special_tokens=False)]
    body = {"model": "demo", "prompt": ids, "max_tokens": len(forced), "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 0, "skip_special_tokens": skip_special}
    worker.engine.logits_hook = forcing(forced)
    try:
        whole = httpx.post(f"{worker.url}/v1/completions", timeout=30, json=body).json()["choices"][0]
        with httpx.stream("POST", f"{worker.url}/v1/completions", timeout=30, json={**body, "stream": True}) as r:
            events = [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
    finally:
        worker.engine.logits_hook = None

    text = whole["text"]
    shown = tok.decode(ids, skip_special_tokens=False)
    assert shown == "<s>" + PROMPT and text == shown + tok.decode(forced, skip_special_tokens=skip_special)
    want = [len(tok.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))]
    want += [len(shown) + len(tok.decode(forced[:j], skip_special_tokens=skip_special)) for j in range(len(forced))]
    lp = whole["logprobs"]
    assert lp["text_offset"] == want and lp["tokens"][0] == "<s>"
    for token, start in zip(lp["tokens"][1:], lp["text_offset"][1:]):  # each shown token's text is there
        assert text.startswith(token, start) or (token == "<pad>" and skip_special)
    assert [o for e in events for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])] == want


# -- errors: OpenAI envelope, 4xx, never a 500 --------------------------------------------------------


BAD = [
    ({"model": "nope", "prompt": "x"}, 404),
    ({"model": "demo", "prompt": "x", "lora_adapters": [{"name": "nope"}]}, 404),
    ({"model": "demo", "prompt": "x", "lora_adapters": [{"name": n} for n in ("sql", "chat", "poem", "code")]}, 400),
    ({"model": "sql", "prompt": "x", "lora_adapters": [{"name": "chat"}]}, 400),
    ({"model": "demo", "prompt": "x", "lora_adapters": [{"name": "sql", "scale": "big"}]}, 400),
    ({"model": "demo", "prompt": "x", "temperature": -1}, 400),
    ({"model": "demo", "prompt": "x", "max_tokens": 0}, 400),
    ({"model": "demo", "prompt": "x", "max_tokens": 100000}, 400),
    ({"model": "demo", "prompt": "x", "n": 17}, 400),
    ({"model": "demo", "prompt": "x", "best_of": 3}, 400),
    ({"model": "demo", "prompt": "x", "presence_penalty": 2.5}, 400),
    ({"model": "demo", "prompt": "x", "logit_bias": {"10": 101}}, 400),
    ({"model": "demo", "prompt": []}, 400),
    ({"model": "demo", "prompt": [10 ** 9]}, 400),
    ({"model": "demo", "prompt": [[-1, 2]]}, 400),
    ({"model": "demo", "prompt": {"a": 1}}, 400),
    ({"model": "demo"}, 400),
    ({"model": "demo", "prompt": "x", "stop": [""]}, 400),
    ({"model": "demo", "prompt": "x", "logprobs": 50}, 400),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("body,status", BAD)
def test_bad_completions_requests(worker, body, status, stream):
    r = httpx.post(f"{worker.url}/v1/completions", json={**body, "stream": stream})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]


BAD_CHAT = [
    ({"model": "demo", "messages": []}, 400),
    ({"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ({"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
]


@pytest.mark.parametrize("body,status", BAD_CHAT)
def test_bad_chat_requests(worker, body, status):
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status


def test_malformed_json_is_400(worker):
    r = httpx.post(f"{worker.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={
            "lora_adapters": [{"name": n} for n in ("sql", "chat", "poem", "code")]})


# -- load: concurrency and cancellation ---------------------------------------------------------------


def _inventory(worker) -> dict:
    return httpx.get(f"{worker.url}/v1/adapters", headers=auth()).json()


def _idle(worker) -> bool:
    inv = _inventory(worker)
    return inv["num_requests_running"] == 0 and inv["num_requests_waiting"] == 0 and inv["kv_cache_usage"] == 0.0


def test_fifty_concurrent_streaming_clients_finish(worker):
    models = ["demo", "sql", "chat", "poem", "code", "legal"]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=models[i % len(models)], prompt=f"{PROMPT} {i}",
                                                 max_tokens=16, temperature=0.8, seed=i, stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(50))), 120)

    results = asyncio.run(main())
    assert len(results) == 50 and all(reason in ("length", "stop") for _, reason in results)
    wait_for(lambda: _idle(worker))


def test_stream_disconnect_cancels_and_frees_blocks(worker):
    body = {"model": "chat", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{worker.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            line = next(lines)
            while not line:
                line = next(lines)
            assert json.loads(line.removeprefix("data: "))["choices"]
        inv = _inventory(worker)
        assert inv["num_requests_running"] == 1 and inv["kv_cache_usage"] > 0
    # The connection is closed mid-stream: the request is aborted and its blocks freed.
    wait_for(lambda: _idle(worker))
    chat = next(a for a in _inventory(worker)["adapters"] if a["name"] == "chat")
    assert chat["requests_in_flight"] == 0


def test_non_streaming_disconnect_cancels(worker):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", json=body, timeout=0.5)
    wait_for(lambda: _idle(worker))


# -- metrics ---------------------------------------------------------------------------------------


def test_metrics_have_vllm_names_and_ours(worker, client):
    client.completions.create(model="sql", prompt=PROMPT, max_tokens=3)
    text = httpx.get(f"{worker.url}/metrics").text
    for needle in (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}',
        'vllm:num_requests_running{model_name="demo"} 0.0',
        'vllm:num_requests_waiting{model_name="demo"} 0.0',
        'vllm:num_requests_waiting_by_reason{model_name="demo",reason="deferred"}',
        'vllm:kv_cache_usage_perc{model_name="demo"}',
        'lorafleet:lora_adapter_resident{adapter="sql",tier="gpu"} 1.0',
        'lorafleet:lora_load_seconds_bucket{le="0.0001",tier="gpu"}',
        'lorafleet:lora_cache_hits_total{tier="gpu"}',
        'lorafleet:lora_cache_misses_total{tier="cpu"}',
        'lorafleet:lora_cache_evictions_total{tier="gpu"}',
        'vllm:generation_tokens_total{model_name="demo"}',
        'vllm:time_to_first_token_seconds_bucket',
        'vllm:inter_token_latency_seconds_bucket',
    ):
        assert needle in text, needle


def test_residency_under_vllms_metric_names(worker, client):
    """vllm:lora_adapter_loaded (vLLM PR #54830's labels) lists exactly the inventory's gpu and cpu
    adapters with their rank and pin; vllm:max_gpu_lora_adapters is max_loras."""
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    inventory = httpx.get(f"{worker.url}/v1/adapters", headers=auth()).json()
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{worker.url}/metrics").text)}
    loaded = {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"], s.labels["rank"])
              for s in families["vllm:lora_adapter_loaded"].samples if s.value == 1}
    want = {(a["name"], a["tier"], str(a["pinned"]).lower(), str(a["rank"]))
            for a in inventory["adapters"] if a["tier"] in ("gpu", "cpu")}
    assert loaded == want and ("sql", "gpu") in {(n, lvl) for n, lvl, _, _ in loaded}
    assert [s.value for s in families["vllm:max_gpu_lora_adapters"].samples] == [inventory["max_loras"]]


def test_lora_requests_info_names_running_adapters(worker):
    body = {"model": "poem", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{worker.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        assert next(lines).startswith("data: ")
        text = http.get(f"{worker.url}/metrics").text
    assert 'running_lora_adapters="poem"' in text, [ln for ln in text.splitlines() if "lora_requests_info{" in ln or "running{" in ln]
    wait_for(lambda: _idle(worker))

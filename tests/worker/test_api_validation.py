"""Bad input on the public API: a 400 that says why, for that request only, found before it costs
the worker anything (no tokenizing of text that cannot fit, nothing that fails the batch), and the
event loop kept free while prompts are tokenized."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.worker_harness import CHAT, PROMPT


@pytest.fixture(scope="module")
def offline(demo_model, demo_adapters, worker):
    """A second engine with the same settings, run offline (no server)."""
    return LLMEngine(demo_model, worker.runtime.settings.engine,
                     lora_modules={n: str(p) for n, p in demo_adapters.items()})


def post(worker, route: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/{route}", json=body, timeout=60, **kw)


def post_raw(worker, route: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/{route}", content=content, headers=headers or {}, timeout=60)


def message(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400
    return err["message"]


def greedy_text(worker, body: dict) -> str:
    r = post(worker, "completions", {**body, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# -- seed -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_torch_cannot_take_is_400_and_spares_the_requests_in_flight(worker, seed):
    """The seed was only used inside the engine step, where torch refused it and failed every
    request of the batch with a 500; now it is refused with the request, the others stream on."""
    good = {"model": "sql", "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    url = f"{worker.url}/v1/completions"

    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> str:
        text = []
        async with client.stream("POST", url, json={**good, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                started.set()
        return "".join(text)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event() for _ in range(2)]
            running = [asyncio.create_task(stream(client, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            bad = await client.post(url, json={"model": "code", "prompt": "x", "max_tokens": 4, "temperature": 0.5,
                                               "seed": seed})
            return bad, await asyncio.gather(*running)

    bad, texts = asyncio.run(main())
    assert "seed" in message(bad) and "18446744073709551615" in message(bad)
    alone = greedy_text(worker, good)
    assert texts == [alone, alone]


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seeds_at_the_ends_of_the_range_are_served(worker, seed):
    body = {"model": "chat", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.9, "seed": seed}
    first, second = post(worker, "completions", body), post(worker, "completions", body)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


# -- text that is not Unicode -----------------------------------------------------------------------


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": "a\ud800b"}),
    ("completions", {"prompt": ["fine", "\udfff"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\udc00"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}),
], ids=["prompt", "second-prompt", "chat", "chat-part"])
def test_a_lone_surrogate_is_400(worker, route, body):
    """JSON's "\\ud800" escape parses to a string UTF-8 cannot hold; the tokenizer raised TypeError (500)."""
    raw = json.dumps({"model": "demo", "max_tokens": 2, **body}).encode()  # ASCII: the escape stays an escape
    text = message(post_raw(worker, route, raw, {"content-type": "application/json"}))
    assert "surrogate" in text


# -- temperature ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 9e-6])
def test_a_temperature_below_1e_5_is_greedy(worker, temperature):
    """In float32 such a temperature is 0 or subnormal, and logits / T overflowed to inf."""
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    r = post(worker, "completions", {**body, "temperature": temperature})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(worker, body)


# -- stop_token_ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ids,needle", [
    ([7] * 65, "at most 64"),
    ([600], "0..511"),
    ([7, -1], "0..511"),
], ids=["too-many", "out-of-vocab", "negative"])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_stop_token_ids_are_400(worker, route, ids, needle):
    body = {"model": "demo", "max_tokens": 4, "stop_token_ids": ids}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    text = message(post(worker, route, body))
    assert "stop_token_ids" in text and needle in text


def test_stop_token_ids_up_to_the_cap_still_stop(worker, offline):
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = offline.generate([PROMPT], sp, [(("sql", 1.0),)])[0].token_ids
    stop = tokens[2]
    others = [t for t in range(6, 512) if t not in tokens[:3]][:63]
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "stop_token_ids": others + [stop]}
    r = post(worker, "completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == tokens.index(stop) + 1


# -- prompt size and the event loop ----------------------------------------------------------------


class CountingTokenizer:
    """Records calls into the worker's tokenizer; `delay` makes each call slow (sleeping, GIL free)."""

    def __init__(self, monkeypatch, tokenizer, delay: float = 0.0) -> None:
        self.names: list[str] = []  # list.append is atomic: calls may come from several threads
        for name in ("encode", "apply_chat_template"):
            original = getattr(tokenizer, name)

            def wrapped(*args, _original=original, _name=name, **kwargs):
                self.names.append(_name)
                time.sleep(delay)
                return _original(*args, **kwargs)

            monkeypatch.setattr(tokenizer, name, wrapped)

    @property
    def calls(self) -> int:
        return len(self.names)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(worker, route, monkeypatch):
    limit = worker.engine.max_prompt_chars
    assert limit < 10**6
    counted = CountingTokenizer(monkeypatch, worker.engine.tokenizer)
    text = "hello world " * (limit // 12 + 1)
    body = {"model": "demo", "max_tokens": 2}
    body |= {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}
    t0 = time.perf_counter()
    refused = message(post(worker, route, body))
    assert str(limit) in refused and "characters" in refused
    assert counted.calls == 0
    assert time.perf_counter() - t0 < 5


def test_twenty_megabytes_of_prompt_are_refused_quickly(worker):
    body = json.dumps({"model": "demo", "prompt": "hello world " * (20 * 2**20 // 12), "max_tokens": 2}).encode()
    t0 = time.perf_counter()
    r = post_raw(worker, "completions", body, {"content-type": "application/json"})
    assert "characters" in message(r)
    assert time.perf_counter() - t0 < 5


def test_tokenizing_and_templating_run_off_the_event_loop(worker, monkeypatch):
    """Slow tokenizer calls (0.3 s each, 8 of them) must not stall the loop: /health answers meanwhile."""
    counted = CountingTokenizer(monkeypatch, worker.engine.tokenizer, delay=0.3)
    base = {"model": "demo", "max_tokens": 2}
    bodies = [("completions", {**base, "prompt": f"{PROMPT} {i}"}) for i in range(3)]
    bodies += [("completions", {**base, "prompt": ["one", "two"]})]
    bodies += [("chat/completions", {**base, "messages": CHAT})] * 2  # a template, then an encode each

    async def main():
        async with httpx.AsyncClient(base_url=worker.url, timeout=60) as client:
            requests = [asyncio.create_task(client.post(f"/v1/{route}", json=b)) for route, b in bodies]
            await asyncio.sleep(0.05)
            latencies = []
            while not all(r.done() for r in requests):
                t0 = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
            return [r.result() for r in requests], latencies

    responses, latencies = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert counted.calls == 9
    assert latencies and max(latencies) < 0.25, latencies


# -- validation messages ----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[1.5], [[1, "a"]], [None], 3, [["a"]]])
def test_a_prompt_of_the_wrong_shape_says_what_a_prompt_may_be(worker, prompt):
    text = message(post(worker, "completions", {"model": "demo", "prompt": prompt}))
    assert text.startswith("prompt:"), text
    assert "a string, a list of strings, a list of token ids or a list of lists of token ids" in text


def test_a_text_part_without_text_says_the_text_is_missing(worker):
    body = {"model": "demo", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    text = message(post(worker, "chat/completions", body))
    assert "text" in text and "missing" in text and "not supported" not in text


STRICT = [
    ("completions", "max_tokens", True),
    ("completions", "max_tokens", "4"),
    ("completions", "n", True),
    ("completions", "n", "2"),
    ("completions", "seed", True),
    ("completions", "seed", 1.5),
    ("completions", "logprobs", True),
    ("completions", "top_k", False),
    ("completions", "stream", "false"),
    ("completions", "stream", 0),
    ("completions", "echo", "false"),
    ("completions", "ignore_eos", "true"),
    ("completions", "stop_token_ids", [True]),
    ("completions", "temperature", "0.5"),
    ("completions", "stream_options", {"include_usage": "yes"}),
    ("chat/completions", "max_completion_tokens", True),
    ("chat/completions", "logprobs", "true"),
    ("chat/completions", "top_logprobs", True),  # with logprobs: true (added below)
    ("chat/completions", "stream", "false"),
    ("chat/completions", "stream", 0),
]


@pytest.mark.parametrize("route,field,value", STRICT, ids=[f"{r.split('/')[0]}-{f}-{v!r}" for r, f, v in STRICT])
def test_json_types_are_not_coerced(worker, route, field, value):
    """`max_tokens: true` was served as 1 and `"stream": "false"` as false: JSON's types are kept."""
    body = {"model": "demo", "max_tokens": 2, field: value}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    if field == "top_logprobs":
        body["logprobs"] = True
    r = post(worker, route, body)
    text = message(r)
    assert text.startswith(field), text
    param = r.json()["error"]["param"]
    assert param == field or param.startswith(f"{field}."), param  # the field, or a field inside it


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                                     {}], ids=["text-plain", "form", "none"])
def test_a_json_body_without_the_json_content_type_says_so(worker, headers):
    raw = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": 2}).encode()
    text = message(post_raw(worker, "completions", raw, headers))
    assert "Content-Type: application/json" in text


@pytest.mark.parametrize("raw,at", [(b'{"prompt": "hi"', 15), (b'{"model": "demo",}', 17)])
def test_a_body_that_is_not_json_says_where_it_stops_parsing(worker, raw, at):
    """The parser's offset was reported as the field (param "14")."""
    r = post_raw(worker, "completions", raw, {"content-type": "application/json"})
    assert r.json()["error"]["param"] is None, r.text
    assert message(r).startswith("the request body is not valid JSON (") and f"at character {at})" in message(r)


def test_an_empty_body_says_so(worker):
    r = post_raw(worker, "completions", b"", {"content-type": "application/json"})
    assert message(r) == "the request body is empty: send a JSON object" and r.json()["error"]["param"] is None


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"stop": [1]}, "stop"), ("completions", {"stop": 5}, "stop"),
    ("chat/completions", {"stop": [1]}, "stop"), ("completions", {"prompt": PROMPT, "logit_bias": {"5": "x"}}, "logit_bias.5"),
])
def test_a_union_fields_error_names_the_field_not_the_member_tried(worker, route, body, param):
    """pydantic's loc names the union member that failed ("stop.str"): `param` is the field."""
    base = {"model": "demo", "max_tokens": 2} | ({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})
    r = post(worker, route, base | body)
    assert r.json()["error"]["param"] == param, r.text
    assert message(r).startswith(f"{param}: "), r.text


def test_json_content_type_variants_are_accepted(worker):
    raw = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": 2}).encode()
    for ct in ("application/json", "application/json; charset=utf-8"):
        assert post_raw(worker, "completions", raw, {"content-type": ct}).status_code == 200

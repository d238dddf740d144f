"""The router in front of a real worker (in-process, CPU, demo model), driven by the official `openai`
client: JSON null is "not given", `n` choices pass through (streamed or not), and what the worker
refuses reaches the client as the worker's 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from lorafleet.router.settings import RouterSettings
from tests.router.conftest import RouterThread
from tests.worker.worker_harness import PROMPT, TOKEN, serve

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

CHAT = [{"role": "user", "content": "hi"}]
MAX_N = 4  # the router's cap here, below the worker's 16


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    yield from serve(demo_model, demo_adapters, token_file=token_file)


@pytest.fixture(scope="module")
def router(worker, demo_adapters):
    settings = RouterSettings(workers=(worker.url,), admin_token=TOKEN, poll_interval_s=0.2, max_n=MAX_N,
                              lora_modules={n: str(p) for n, p in demo_adapters.items()})
    with RouterThread(settings) as r:
        yield r


@pytest.fixture(scope="module")
def via_router(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def direct(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_null_fields_are_not_given(router, route):
    """The router refused `"stream": null` and `"n": null` (400) before the worker saw them."""
    body = {"model": "sql", "max_tokens": 3, "stream": None, "n": None, "temperature": None, "seed": None,
            "stop": None, "stream_options": None, "logprobs": None, "user": None, "max_completion_tokens": None}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    r = httpx.post(f"{router.url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json") and len(r.json()["choices"]) == 1


def test_the_official_client_sending_none_through_the_router(via_router):
    r = via_router.completions.create(model="sql", prompt=PROMPT, max_tokens=3, n=None, stream=None, seed=None)
    assert len(r.choices) == 1 and r.object == "text_completion"


def test_n_choices_through_the_router_match_the_worker(via_router, direct):
    kw = dict(model="poem", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=21, n=3)
    want = direct.completions.create(**kw)
    got = via_router.completions.create(**kw)
    assert [(c.index, c.text) for c in got.choices] == [(c.index, c.text) for c in want.choices]
    assert got.usage.model_dump() == want.usage.model_dump()
    chunks = list(via_router.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {c.index: c.text for c in want.choices}
    assert chunks[-1].usage.model_dump() == want.usage.model_dump()


def test_n_chat_streamed_through_the_router(via_router):
    chunks = list(via_router.chat.completions.create(model="chat", messages=CHAT, max_tokens=4, n=2, seed=2,
                                                     temperature=1.0, stream=True))
    assert {ch.index for c in chunks for ch in c.choices} == {0, 1}
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason) == [0, 1]


def test_n_above_the_routers_cap_is_its_400(via_router):
    with pytest.raises(openai.BadRequestError) as err:
        via_router.completions.create(model="sql", prompt=PROMPT, max_tokens=2, n=MAX_N + 1)
    assert err.value.body["param"] == "n"
    assert err.value.body["message"] == f"n: Input should be less than or equal to {MAX_N}"


def test_penalties_and_logit_bias_pass_through_the_router(via_router, direct):
    """OpenAI's knobs and vLLM's (in extra_body) reach the worker unchanged: the same text as asking
    the worker directly, and a bad value is the worker's 400 naming the field."""
    kw = dict(model="sql", prompt=PROMPT, max_tokens=8, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
              logit_bias={"77": 4}, extra_body={"repetition_penalty": 1.3, "min_tokens": 3, "min_p": 0.1})
    got, want = via_router.completions.create(**kw).choices[0].text, direct.completions.create(**kw).choices[0].text
    plain = direct.completions.create(model="sql", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert got == want != plain
    with pytest.raises(openai.BadRequestError) as err:
        via_router.completions.create(model="sql", prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 9})
    assert err.value.body["param"] == "min_tokens"


def test_prompt_scoring_through_the_router_is_the_workers(via_router, direct, router):
    """lm-eval-harness pointed at the router: echo + logprobs scores the prompt on the replica holding
    the adapter, as asking that worker directly; vLLM's prompt_logprobs passes through too."""
    kw = dict(model="poem", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    got, want = via_router.completions.create(**kw).choices[0], direct.completions.create(**kw).choices[0]
    assert got.text == want.text and got.logprobs.token_logprobs == want.logprobs.token_logprobs
    assert got.logprobs.token_logprobs[0] is None and len(got.logprobs.tokens) > 2
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "poem", "prompt": PROMPT, "max_tokens": 1,
                                                         "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"][0] is None


def test_an_unsupported_feature_is_the_workers_400(via_router):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        via_router.chat.completions.create(model="chat", messages=CHAT, max_tokens=2, tools=[tool], stream=True)
    assert err.value.body["param"] == "tool_choice" and "parser" in err.value.body["message"]  # "auto" by default


# The router's own field checks (`check_fields`, `model`, `lora_adapters`; refusing before routing),
# with the worker as the oracle: the same 400 and error object whichever of the two refuses.
ROUTER_CHECKED = [
    ("completions", {"max_tokens": 0}), ("chat/completions", {"max_tokens": 0, "echo": True}),
    ("completions", {"max_tokens": True}), ("completions", {"max_tokens": "5"}),
    ("completions", {"n": 0}), ("completions", {"n": False}), ("completions", {"stream": "false"}),
    ("completions", {"stream": 0}), ("chat/completions", {"max_completion_tokens": 0}),
    ("chat/completions", {"stream": "false"}), ("completions", {"model": 5}),
    ("completions", {"model": "demo", "lora_adapters": [{"name": "sql", "scale": "x"}]}),
    ("chat/completions", {"model": "demo", "lora_adapters": [{"scale": 1.0}]}),
]


@pytest.mark.parametrize("route,fields", ROUTER_CHECKED, ids=[f"{r.split('/')[0]}-{f}" for r, f in ROUTER_CHECKED])
def test_the_routers_field_checks_say_what_the_worker_says(router, worker, route, fields):
    body = {"model": "sql", **fields} | ({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})
    by_router = httpx.post(f"{router.url}/v1/{route}", json=body, timeout=60)
    by_worker = httpx.post(f"{worker.url}/v1/{route}", json=body, timeout=60)
    assert by_router.status_code == by_worker.status_code == 400, (by_router.text, by_worker.text)
    assert "x-lorafleet-replica" not in by_router.headers  # refused by the router itself, not passed on
    router_error, worker_error = by_router.json()["error"], by_worker.json()["error"]
    assert router_error == worker_error


# vLLM's tokenizer routes through the router: any replica of the base answers, nothing is loaded.

@pytest.mark.parametrize("route,body", [
    ("tokenize", {"prompt": PROMPT, "return_token_strs": True}),
    ("tokenize", {"messages": CHAT, "add_generation_prompt": False}),
    ("detokenize", {"tokens": [5, 40, 41, 300]}),
])
@pytest.mark.parametrize("model", ["sql", "demo", None], ids=["adapter", "base", "no-model"])
def test_tokenizer_routes_answer_as_the_worker(router, worker, route, body, model):
    """The worker (asked for its base) is the oracle; an adapter's name or none (one base served)
    answers the same, from a replica (scheduled as a base-model request)."""
    sent = body | ({} if model is None else {"model": model})
    by_router = httpx.post(f"{router.url}/{route}", json=sent, timeout=60)
    by_worker = httpx.post(f"{worker.url}/{route}", json=body | {"model": "demo"}, timeout=60)
    assert by_router.status_code == by_worker.status_code == 200, (by_router.text, by_worker.text)
    assert by_router.json() == by_worker.json() and by_router.headers["x-lorafleet-replica"]


def test_tokenizer_routes_refuse_an_unknown_model_themselves(router):
    r = httpx.post(f"{router.url}/tokenize", json={"model": "nope", "prompt": PROMPT}, timeout=60)
    assert r.status_code == 404 and "x-lorafleet-replica" not in r.headers, r.text
    bad = httpx.post(f"{router.url}/detokenize", json={"model": "sql", "tokens": [-1]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text


def test_responses_through_the_router_are_the_workers(via_router, direct):
    """OpenAI's Responses API, routed by its model (an adapter): the worker's answer, streamed or not."""
    kw = dict(model="sql", input="hi", max_output_tokens=5, temperature=0)
    want, got = direct.responses.create(**kw), via_router.responses.create(**kw)
    assert got.output_text == want.output_text and got.usage == want.usage and got.status == want.status
    with via_router.responses.stream(**kw) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].response.usage == want.usage
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text


def test_responses_max_output_tokens_is_capped_by_the_router(via_router):
    with pytest.raises(openai.BadRequestError, match="max_output_tokens: Input should be less than or equal to"):
        via_router.responses.create(model="sql", input="hi", max_output_tokens=10**9)


@pytest.mark.parametrize("client", ["via_router", "direct"])
def test_stored_responses_are_404s_saying_none_is_kept(client, request):
    c = request.getfixturevalue(client)
    for call in (lambda: c.responses.retrieve("resp_1"), lambda: c.responses.delete("resp_1"),
                 lambda: c.responses.cancel("resp_1"), lambda: c.responses.input_items.list("resp_1")):
        with pytest.raises(openai.NotFoundError, match="'resp_1' not found: this server keeps no responses"):
            call()


def test_the_routers_stored_response_404_is_the_workers(router, worker):
    by_router, by_worker = (httpx.get(f"{u}/v1/responses/resp_1", timeout=60) for u in (router.url, worker.url))
    assert by_router.status_code == by_worker.status_code == 404 and "x-lorafleet-replica" not in by_router.headers
    assert by_router.json() == by_worker.json()

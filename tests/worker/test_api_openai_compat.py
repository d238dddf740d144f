"""What a client of OpenAI's API (or vLLM's) expects from the worker, through the official `openai`
client where it can send it: JSON null as "not given", `n` choices per prompt, `max_completion_tokens`,
`stream_options`, penalties and `logit_bias` (and vLLM's `min_p`, `min_tokens`, `repetition_penalty`,
`allowed_token_ids`), and a 400 naming each field the worker does not implement (never silence)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.worker.worker_harness import CHAT, PROMPT, wait_for


def post(worker, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/{route}", json=body, timeout=60)


def events(worker, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{worker.url}/v1/{route}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def refused(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param, err
    return err["message"]


def texts_by_index(chunks, field: str = "text") -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            piece = ch.text if field == "text" else (ch.delta.content or "")
            out[ch.index] = out.get(ch.index, "") + piece
    return out


# -- null means "not given" ---------------------------------------------------------------------------

NULLABLE = ["stream", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs", "stream_options",
            "presence_penalty", "frequency_penalty", "user", "logit_bias", "echo", "best_of", "suffix", "top_k",
            "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "lora_adapters"]
NULLABLE_CHAT = ["stream", "n", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "stream_options",
                 "seed", "stop", "add_generation_prompt", "tools", "tool_choice", "response_format"]


@pytest.mark.parametrize("field", NULLABLE)
def test_null_is_the_default_on_completions(worker, field):
    """`"stream": null` and `"n": null` were 400s (strict types): OpenAI takes null as not given."""
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    want = post(worker, "completions", body).json()
    r = post(worker, "completions", {**body, field: None})
    assert r.status_code == 200, r.text
    got = r.json()  # not streamed, one choice, no logprobs: the defaults
    assert len(got["choices"]) == 1 and got["choices"][0]["logprobs"] is None
    if field == "max_tokens":
        assert got["usage"]["completion_tokens"] == 16  # the completions default
    elif field != "temperature":
        assert got["choices"][0]["text"] == want["choices"][0]["text"]


@pytest.mark.parametrize("field", NULLABLE_CHAT)
def test_null_is_the_default_on_chat(worker, field):
    limit = "max_completion_tokens" if field == "max_tokens" else "max_tokens"
    body = {"model": "chat", "messages": CHAT, limit: 5, "temperature": 0, "ignore_eos": True}
    want = post(worker, "chat/completions", body).json()
    r = post(worker, "chat/completions", {**body, field: None})
    assert r.status_code == 200, r.text
    got = r.json()
    assert len(got["choices"]) == 1 and got["choices"][0]["logprobs"] is None
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["usage"] == want["usage"]


def test_the_official_client_sending_none_is_served(client):
    """The `openai` client sends an explicit None as JSON null."""
    kw = dict(stream=None, n=None, temperature=None, top_p=None, stop=None, seed=None, logprobs=None,
              stream_options=None, presence_penalty=None, frequency_penalty=None, user=None)
    r = client.completions.create(model="sql", prompt=PROMPT, max_tokens=None, **kw)
    assert len(r.choices) == 1 and r.usage.completion_tokens >= 1
    c = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=4, max_completion_tokens=None,
                                       top_logprobs=None, **kw)
    assert len(c.choices) == 1 and c.choices[0].message.role == "assistant"


# -- n choices per prompt -------------------------------------------------------------------------------


def batch_invariant(worker) -> bool:
    """Whether a request's logits are bit-equal whatever else is in its batch. On the CPU they are;
    on CUDA a batch of 3 and a batch of 1 take different GEMM algorithms, and at temperature 1 a
    near-tie in the race between the random demo model's tokens may go either way (the GPU run of
    this suite showed one such flip). There, choices are compared within equal batches only."""
    return worker.engine.device.type == "cpu"


def test_n_choices_are_seeded_distinct_and_reproducible(client, worker):
    """n was refused (400); choice i of a seeded request draws from seed + i, as in vLLM."""
    kw = dict(model="poem", prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    client.completions.create(**kw | {"max_tokens": 1})  # the prompt's blocks cached for every request below
    r = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3
    assert [c.text for c in client.completions.create(n=3, seed=11, **kw).choices] == texts
    alone = [client.completions.create(seed=11 + i, **kw) for i in range(3)]
    if batch_invariant(worker):
        assert texts == [a.choices[0].text for a in alone]
    # usage: the prompt once, the completion tokens of every choice
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_n_seed_at_the_top_of_the_range_wraps(client, worker):
    """Choice 1 of seed 2**64 - 1 draws from seed 2**64, which wraps to 0: the same choices as
    seed -1 (torch's other name for 2**64 - 1), whose choice 1 is seed 0."""
    kw = dict(model="poem", prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    client.completions.create(**kw | {"max_tokens": 1})  # equal prefix-cache state for both requests
    top = [c.text for c in client.completions.create(n=2, seed=2**64 - 1, **kw).choices]
    assert top == [c.text for c in client.completions.create(n=2, seed=-1, **kw).choices]
    assert top[0] != top[1]
    if batch_invariant(worker):
        assert top[1] == client.completions.create(seed=0, **kw).choices[0].text


def test_n_with_several_prompts_orders_choices_by_prompt(client):
    kw = dict(model="sql", max_tokens=6, temperature=0)
    r = client.completions.create(prompt=[PROMPT, "Roses are red"], n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    first = client.completions.create(prompt=PROMPT, **kw)
    second = client.completions.create(prompt="Roses are red", **kw)
    assert [c.text for c in r.choices] == [first.choices[0].text] * 2 + [second.choices[0].text] * 2
    assert r.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(c.usage.completion_tokens for c in (first, second)) * 2


def test_n_streamed_completions_carry_their_choice_index(client):
    kw = dict(model="code", prompt=PROMPT, max_tokens=7, temperature=0.9, seed=5, n=3,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert texts_by_index(chunks) == {c.index: c.text for c in whole.choices}
    finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)


def test_n_chat_plain_and_streamed(client):
    kw = dict(model="chat", messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in whole.choices)
    assert whole.choices[0].message.content != whole.choices[1].message.content
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert roles == [0, 1]  # one role chunk per choice, first
    assert texts_by_index(chunks, "delta") == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_n_with_logprobs_gives_each_choice_its_own(client):
    r = client.completions.create(model="sql", prompt=PROMPT, max_tokens=4, n=2, seed=1, logprobs=1,
                                  extra_body={"ignore_eos": True})
    for c in r.choices:
        assert len(c.logprobs.tokens) == 4 and "".join(c.logprobs.tokens) != ""
    assert r.choices[0].logprobs.token_logprobs != r.choices[1].logprobs.token_logprobs


@pytest.mark.parametrize("n,needle", [(17, "less than or equal to 16"), (0, "greater than or equal to 1")])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_n_out_of_range_is_400(worker, route, n, needle):
    body = {"model": "demo", "max_tokens": 2, "n": n}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    assert refused(post(worker, route, body), "n") == f"n: Input should be {needle}"


def test_best_of_equal_to_n_is_served_other_values_are_400(worker):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2, "n": 2}
    r = post(worker, "completions", {**body, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    assert "greater than or equal to n" in refused(post(worker, "completions", {**body, "best_of": 1}), "best_of")
    assert "not supported" in refused(post(worker, "completions", {**body, "best_of": 3}), "best_of")


# -- max_completion_tokens -------------------------------------------------------------------------------


def test_max_completion_tokens_bounds_chat_and_wins_over_max_tokens(client):
    kw = dict(model="chat", messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(max_completion_tokens=3, **kw).usage.completion_tokens == 3
    r = client.chat.completions.create(max_completion_tokens=3, max_tokens=7, **kw)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


# -- stream_options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(worker, route):
    """vLLM's continuous_usage_stats (with include_usage): a chunk's usage is its choice's so far."""
    body = {"model": "demo", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    chunks = events(worker, route, body)
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    prompt_tokens = last["usage"]["prompt_tokens"]
    for index in (0, 1):
        used = [c["usage"] for c in per_choice if c["choices"][0]["index"] == index]
        assert {u["prompt_tokens"] for u in used} == {prompt_tokens}
        counts = [u["completion_tokens"] for u in used]
        assert counts == sorted(counts) and counts[-1] == 5, counts
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in used)


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True}, {"include_usage": True}])
def test_chunks_carry_usage_only_with_both_options(worker, options):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 3, "stream_options": options}
    assert all("usage" not in c for c in events(worker, "completions", body) if c["choices"])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_options_without_stream_is_400(worker, route):
    """OpenAI and vLLM refuse it; it was silently ignored."""
    body = {"model": "demo", "max_tokens": 2, "stream_options": {"include_usage": True}}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": CHAT}
    assert "stream" in refused(post(worker, route, body), "stream_options")
    empty = post(worker, route, body | {"stream_options": {}})  # vLLM refuses only options that say something
    assert empty.status_code == 200, empty.text


def test_include_usage_false_sends_no_usage_chunk(worker):
    chunks = events(worker, "completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 3,
                                            "stream_options": {"include_usage": False}})
    assert all(c["choices"] and "usage" not in c for c in chunks)


# -- fields not implemented: a 400 that names them; harmless values accepted ------------------------------

UNSUPPORTED = [  # (tools themselves: tests/worker/test_tools.py)
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "lookup"}}),
    ("functions", [{"name": "lookup"}]),
    ("function_call", {"name": "lookup"}),
    ("best_of", 2),
    ("modalities", ["text", "audio"]),
    ("use_beam_search", True),
    ("priority", 1), ("request_id", "abc"), ("return_token_ids", True), ("cache_salt", "x"),
    ("spaces_between_special_tokens", False), ("truncate_prompt_tokens", 3), ("prompt_embeds", "AAAA"),
    ("continue_final_message", True), ("chat_template", "{{ messages }}"), ("documents", [{"text": "d"}]),
    ("include_reasoning", False), ("add_special_tokens", True), ("vllm_xargs", {"k": 1}),
]
HARMLESS = [
    ("user", "u-1"), ("metadata", {"k": "v"}), ("store", False), ("parallel_tool_calls", True),
    ("service_tier", "auto"), ("tool_choice", "none"), ("tool_choice", "auto"), ("tools", []),
    ("response_format", {"type": "text"}), ("modalities", ["text"]), ("best_of", 1), ("reasoning_effort", "low"),
    ("priority", 0), ("spaces_between_special_tokens", True), ("add_special_tokens", False), ("length_penalty", 1.0),
    ("mm_payload", "tensors"), ("include_reasoning", True), ("continue_final_message", False),
    ("no_such_field_anywhere", 1),  # neither OpenAI's nor vLLM's: ignored, as OpenAI does
]


@pytest.mark.parametrize("field,value", UNSUPPORTED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(UNSUPPORTED)])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_unsupported_features_are_400_naming_the_field(worker, field, value, stream):
    """tools and functions were ignored: the answer looked right and was not what was asked for."""
    body = {"model": "demo", "messages": CHAT, "max_tokens": 2, "stream": stream, field: value}
    assert field in refused(post(worker, "chat/completions", body), field)


@pytest.mark.parametrize("field,value", [("suffix", " end"), ("best_of", 3), ("add_special_tokens", False),
                                         ("priority", -1), ("length_penalty", 0.5)])
def test_unsupported_completions_fields_are_400(worker, field, value):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2, field: value}
    assert field in refused(post(worker, "completions", body), field)


@pytest.mark.parametrize("field,value", HARMLESS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HARMLESS)])
def test_harmless_fields_are_accepted(worker, field, value):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 2, field: value}
    r = post(worker, "chat/completions", body)
    assert r.status_code == 200, r.text


# -- response shape -------------------------------------------------------------------------------------


def test_ids_objects_and_created_are_consistent(worker):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2}
    r = post(worker, "completions", body).json()
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and isinstance(r["created"], int)
    chunks = events(worker, "chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 3})
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["id"].startswith("chatcmpl-") and {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_a_refused_prompt_cancels_the_choices_already_queued(worker):
    """All of a request's sequences are queued together; one refused (a token id out of the
    vocabulary) leaves none of the others running."""
    body = {"model": "demo", "prompt": [[5, 6, 7], [10**9]], "n": 3, "max_tokens": 2000, "ignore_eos": True}
    assert "token ids" in refused(post(worker, "completions", body), "prompt")

    def idle() -> bool:
        text = httpx.get(f"{worker.url}/metrics").text
        return ('vllm:num_requests_running{model_name="demo"} 0.0' in text
                and 'vllm:num_requests_waiting{model_name="demo"} 0.0' in text)

    wait_for(idle, timeout=2)


# -- lora_adapters entries ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["0.5", True])
def test_a_lora_adapters_scale_keeps_jsons_type(worker, scale):
    """Was coerced ("0.5" -> 0.5, true -> 1.0) while the rest of the request was strict."""
    body = {"model": "demo", "prompt": "x", "max_tokens": 1, "lora_adapters": [{"name": "sql", "scale": scale}]}
    assert refused(post(worker, "completions", body), "lora_adapters.0.scale").startswith(
        "lora_adapters.0.scale: Input should be a valid number")


def test_a_null_lora_adapters_scale_is_the_default(worker):
    base = {"model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    null = post(worker, "completions", base | {"lora_adapters": [{"name": "sql", "scale": None}]})
    one = post(worker, "completions", base | {"lora_adapters": [{"name": "sql", "scale": 1.0}]})
    assert null.status_code == 200, null.text
    assert null.json()["choices"][0]["text"] == one.json()["choices"][0]["text"]


def test_a_request_larger_than_a_running_batch_is_400(worker):
    """prompts x n beyond max_num_seqs (64 here) could never run together; 16 x 16 queued 256."""
    body = {"model": "demo", "max_tokens": 1, "n": 16}
    assert post(worker, "completions", body | {"prompt": [PROMPT] * 4}).status_code == 200
    message = refused(post(worker, "completions", body | {"prompt": [PROMPT] * 5}), "n")
    assert message.startswith("prompts x n = 80 sequences, more than this worker runs at once (max_num_seqs 64)")


@pytest.mark.parametrize("k", [0, 1])
def test_completions_top_logprobs_hold_the_sampled_token(client, k):
    """OpenAI: "the API will always return the logprob of the sampled token" (up to logprobs + 1
    entries); logprobs 0 gave `top_logprobs: [null, ...]`, and a sampled token outside the top k
    was missing from its entry."""
    r = client.completions.create(model="poem", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=3, logprobs=k,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top is not None and top[token] == logprob and len(top) <= k + 1
    if k == 0:
        assert all(len(top) == 1 for top in lp.top_logprobs)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(worker, route):
    """vLLM's `return_tokens_as_token_ids`: each logprobs token (chosen and top) is `token_id:N`, with
    N the id; the text and chat's `bytes` stay the token's own."""
    common = {"model": "demo", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if route == "completions":
        body = {**common, "prompt": PROMPT, "logprobs": 3}
    else:
        body = {**common, "messages": CHAT, "logprobs": True, "top_logprobs": 3}
    plain = post(worker, route, body).json()["choices"][0]
    by_id = post(worker, route, {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    if route == "completions":
        assert by_id["text"] == plain["text"]
        tokens = by_id["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for t in tokens) and len(tokens) == len(plain["logprobs"]["tokens"])
        for top in by_id["logprobs"]["top_logprobs"]:
            assert all(k.startswith("token_id:") for k in top)
        texts = [httpx.post(f"{worker.url}/detokenize", json={"model": "demo", "tokens": [int(t[9:])]}, timeout=30)
                 .json()["prompt"] for t in tokens]
        assert "".join(texts) == plain["text"]
    else:
        assert by_id["message"]["content"] == plain["message"]["content"]
        for got, want in zip(by_id["logprobs"]["content"], plain["logprobs"]["content"], strict=True):
            assert got["token"].startswith("token_id:") and got["bytes"] == want["bytes"]
            assert got["logprob"] == want["logprob"]
            assert all(t["token"].startswith("token_id:") for t in got["top_logprobs"])

"""The sampling fields of OpenAI's API and vLLM's extras through the worker, with the official `openai`
client where it can send them: penalties, `logit_bias`, `min_p`, `min_tokens`, `repetition_penalty`,
`allowed_token_ids`, `bad_words`, and prompt scoring (`echo` with logprobs, `prompt_logprobs`, what
lm-eval-harness sends) against transformers + PEFT."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_api_openai_compat import events, post, refused
from tests.worker.worker_harness import CHAT, PROMPT

# -- penalties, logit_bias and vLLM's logit knobs ----------------------------------------------------------


def token_text(worker, token: int) -> str:
    return worker.engine.tokenizer.decode([token], skip_special_tokens=False)


def test_logit_bias_from_the_official_client_decides_the_tokens(client, worker):
    """OpenAI's logit_bias (string keys, -100..100) and penalties, sent as the client sends them."""
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={"77": 100}, frequency_penalty=0.0, presence_penalty=0.0)
    assert out.choices[0].text == token_text(worker, 77) * 4
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={"301": 100})
    assert chat.choices[0].message.content == token_text(worker, 301) * 3


def test_vllm_knobs_through_extra_body(client, worker):
    allowed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1,
                                        extra_body={"allowed_token_ids": [77], "min_p": 0.1,
                                                    "repetition_penalty": 1.3, "min_tokens": 2})
    assert allowed.choices[0].text == token_text(worker, 77) * 6
    # A frequency penalty large enough beats a bias of 3: the biased token is taken until it is not.
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {"77": 3}}
    biased = post(worker, "completions", body).json()["choices"][0]["text"]
    penalised = post(worker, "completions", {**body, "frequency_penalty": 2.0}).json()["choices"][0]["text"]
    assert biased.count(token_text(worker, 77)) > penalised.count(token_text(worker, 77)) >= 1


def test_special_tokens_stay_out_of_the_text_unless_asked(client, worker):
    """vLLM's skip_special_tokens (default true): a special token the model writes is left out of the
    text, not of the tokens; with it false, the text keeps it, streamed and not."""
    (special,) = worker.engine.tokenizer.encode("<|user|>", add_special_tokens=False)
    kw = dict(model="demo", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(special): 100}, logprobs=0)
    skipped = client.completions.create(**kw).choices[0]
    assert skipped.text == "" and skipped.logprobs.tokens == ["<|user|>"] * 3
    kept = client.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0]
    assert kept.text == "<|user|>" * 3
    streamed = client.completions.create(**kw, stream=True, extra_body={"skip_special_tokens": False})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.text
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2, temperature=0,
                                          logit_bias={str(special): 100}, extra_body={"skip_special_tokens": False})
    assert chat.choices[0].message.content == "<|user|>" * 2


def test_bad_words_through_the_official_client(client, worker):
    tok = worker.engine.tokenizer
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    word = next(t for t in plain.choices[0].logprobs.tokens if t.strip() == t and t
                and len(tok.encode(t, add_special_tokens=False)) == 1)
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                    extra_body={"bad_words": [word]})
    assert word not in out.choices[0].logprobs.tokens and out.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize("field,value,message", [
    ("frequency_penalty", 2.5, "less than or equal to 2"),
    ("presence_penalty", -2.5, "greater than or equal to -2"),
    ("repetition_penalty", 0, "greater than 0"),
    ("min_p", 1.5, "less than or equal to 1"),
    ("min_tokens", -1, "greater than or equal to 0"),
    ("logit_bias", {"abc": 1}, "keys must be token ids"),
    ("logit_bias", {"5_0": 1}, "keys must be token ids, got '5_0'"),
    ("logit_bias", {" 5": 1}, "keys must be token ids"),
    ("logit_bias", {"-5": 1}, "keys must be token ids"),
    ("logit_bias", {"\u0665": 1}, "keys must be token ids"),
    ("logit_bias", {"5": "high"}, "valid number"),
])
def test_bad_logit_knobs_are_400_naming_the_field(worker, field, value, message):
    r = post(worker, "completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 4, field: value})
    param = "logit_bias.5" if value == {"5": "high"} else field  # pydantic's location of the bad entry
    assert message in refused(r, param)


@pytest.mark.parametrize("body,message", [
    ({"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"100000": 1}}, "logit_bias must be in 0.."),
    ({"allowed_token_ids": [3, 100000]}, "allowed_token_ids must be in 0.."),
    ({"allowed_token_ids": []}, "allowed_token_ids: 1 to"),
    ({"min_tokens": 5}, "min_tokens must be in 0..max_tokens (4)"),
    ({"stop_token_ids": [100000]}, "stop_token_ids must be in 0.."),
    ({"seed": 2**64}, "seed must be in"),
])
def test_knobs_the_engine_refuses_are_400_naming_the_field(worker, body, message):
    r = post(worker, "completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 4, **body})
    (field,) = body
    assert message in refused(r, field)


# -- echo and prompt logprobs (lm-eval-harness's loglikelihood requests) -------------------------------


@pytest.fixture(scope="module")
def prompt_oracle(demo_model, demo_adapters):
    """transformers (+ PEFT): each prompt token's logprob given the tokens before it."""
    from tests.worker.peft_oracle import load_hf_base, oracle_logits

    base = load_hf_base(demo_model)

    def logprobs(ids: list[int], adapters=()) -> list[float]:
        import torch

        logp = torch.log_softmax(oracle_logits(base, demo_adapters, adapters, ids), dim=-1)
        return [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]

    return logprobs


def logprob_tolerance(worker) -> float:
    """The worker's logprobs against the fp32 oracle: fp32 on the CPU, bf16 on CUDA (the GPU twin)."""
    return 1e-4 if worker.engine.model.dtype == torch.float32 else 5e-2


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, worker, prompt_oracle):
    """lm-eval-harness's request for a loglikelihood: echo, logprobs 1, max_tokens 1; it reads
    token_logprobs over the prompt (the first is null). Against transformers + PEFT, with an adapter."""
    ids = worker.engine.tokenizer.encode(PROMPT)
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = prompt_oracle(ids, (("sql", 1.0),))
    assert max(abs(g - w) for g, w in zip(lp.token_logprobs[1 : len(ids)], want)) < logprob_tolerance(worker)
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, len(ids) + 1))
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1


def test_lm_eval_loglikelihood_batch_of_token_prompts(client, worker, prompt_oracle):
    """What lm-eval-harness's local-completions sends for loglikelihood: token-id prompts (context +
    continuation) in one request, echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1]
    and checks each continuation token is the top one."""
    tok = worker.engine.tokenizer
    pairs = [("The capital of France is", " Paris"), ("Roses are red, violets are", " blue")]
    prompts = [tok.encode(c + x) for c, x in pairs]
    ctxlens = [len(tok.encode(c)) for c, _ in pairs]
    out = client.completions.create(model="poem", prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                    seed=1234)
    for choice, ids, ctxlen in zip(sorted(out.choices, key=lambda c: c.index), prompts, ctxlens):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
        want = prompt_oracle(ids, (("poem", 1.0),))
        got = sum(lp.token_logprobs[ctxlen:-1])
        assert abs(got - sum(want[ctxlen - 1 :])) < 10 * logprob_tolerance(worker)
        greedy = [max(top.items(), key=lambda kv: kv[1])[0] for top in lp.top_logprobs[ctxlen:-1]]
        assert len(greedy) == len(ids) - ctxlen


def test_echo_without_logprobs_prepends_the_prompt(client):
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_streamed_echo_and_prompt_logprobs_are_the_whole_answer_in_pieces(worker):
    """vLLM streams them too: a choice's first chunk carries its prompt (and its tokens' logprobs,
    and vLLM's prompt_logprobs); the pieces join into the non-streamed answer."""
    ids = worker.engine.tokenizer.encode(PROMPT)
    body = {"model": "chat", "prompt": [ids, ids[:6]], "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True,
            "prompt_logprobs": 1, "n": 2}
    r = post(worker, "completions", body)
    assert r.status_code == 200, r.text
    whole = {c["index"]: c for c in r.json()["choices"]}
    pieces: dict[int, dict] = {}
    for chunk in events(worker, "completions", body):
        assert "choices" in chunk, chunk
        for c in chunk["choices"]:
            got = pieces.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "prompt": []})
            got["text"] += c["text"]
            if c.get("prompt_logprobs") is not None:
                got["prompt"].append(c["prompt_logprobs"])
            if c["logprobs"]:
                got["tokens"] += c["logprobs"]["tokens"]
                got["token_logprobs"] += c["logprobs"]["token_logprobs"]
    assert sorted(pieces) == sorted(whole) == [0, 1, 2, 3]
    for i, c in whole.items():
        prompt = ids if i < 2 else ids[:6]
        assert pieces[i]["text"] == c["text"] and len(c["logprobs"]["tokens"]) == len(prompt) + 4
        assert pieces[i]["tokens"] == c["logprobs"]["tokens"]
        assert pieces[i]["token_logprobs"] == c["logprobs"]["token_logprobs"]
        assert pieces[i]["prompt"] == [c["prompt_logprobs"]], "once, in the first chunk"


def test_vllm_prompt_logprobs(worker, prompt_oracle):
    ids = worker.engine.tokenizer.encode(PROMPT)
    body = {"model": "demo", "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    choices = post(worker, "completions", body).json()["choices"]
    want = prompt_oracle(ids)
    for choice in choices:
        got = choice["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for entry, token, w in zip(got[1:], ids[1:], want):
            assert abs(entry[str(token)]["logprob"] - w) < logprob_tolerance(worker)
            ranks = sorted(e["rank"] for e in entry.values())
            assert ranks[:2] == [1, 2] and entry[str(token)]["rank"] >= 1


def test_echo_alone_scores_the_prompt_without_a_completion(client, worker, prompt_oracle):
    """OpenAI's legacy prompt scoring (older lm-eval-harness): echo, logprobs, max_tokens 0. The
    prompt comes back with its tokens' logprobs (against transformers + PEFT) and nothing else:
    the token the engine samples is dropped, none is counted."""
    ids = worker.engine.tokenizer.encode(PROMPT)
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=0, temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None
    want = prompt_oracle(ids, (("sql", 1.0),))
    assert max(abs(g - w) for g, w in zip(lp.token_logprobs[1:], want)) < logprob_tolerance(worker)
    one = client.completions.create(model="sql", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True)
    assert one.choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)


def test_echo_alone_streamed(worker):
    ids = worker.engine.tokenizer.encode(PROMPT)
    body = {"model": "demo", "prompt": [ids, ids[:5]], "max_tokens": 0, "echo": True, "logprobs": 0, "n": 2,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    whole = post(worker, "completions", {**body, "stream": False, "stream_options": None}).json()
    one_token = {**body, "stream": False, "stream_options": None, "max_tokens": 1}
    echoed = post(worker, "completions", one_token).json()["choices"]
    generated = post(worker, "completions", {**one_token, "echo": False}).json()["choices"]
    pieces: dict[int, dict] = {}
    usage = None
    for chunk in events(worker, "completions", body):
        if chunk.get("usage") and not chunk["choices"]:
            usage = chunk["usage"]
            continue
        assert chunk["usage"]["completion_tokens"] == 0
        for c in chunk["choices"]:
            got = pieces.setdefault(c["index"], {"text": "", "tokens": 0, "finish": None})
            got["text"] += c["text"]
            got["tokens"] += len(c["logprobs"]["tokens"]) if c["logprobs"] else 0
            got["finish"] = c["finish_reason"] or got["finish"]
    for c in whole["choices"]:
        i = c["index"]
        assert c["text"] == pieces[i]["text"] and c["text"] + generated[i]["text"] == echoed[i]["text"]
        assert len(c["logprobs"]["tokens"]) == pieces[i]["tokens"] == (len(ids) if i < 2 else 5)
        assert c["finish_reason"] == pieces[i]["finish"] == "length"
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_needs_echo(worker):
    msg = refused(post(worker, "completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 0}), "max_tokens")
    assert "echo" in msg
    refused(post(worker, "chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 0}), "max_tokens")


# -- chat: vLLM's echo and prompt_logprobs ------------------------------------------------------------

PARTIAL = CHAT + [{"role": "assistant", "content": "The capital of France is"}]


def chat_content(worker, body: dict) -> str:
    r = post(worker, "chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chat_echo_continues_the_last_assistant_message(worker):
    """vLLM's chat echo: without a generation prompt the answer continues the last message, and echo
    puts that message's text before it (streamed: in the chunk after the role's)."""
    body = {"model": "demo", "messages": PARTIAL, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False}
    plain = chat_content(worker, body)
    echoed = chat_content(worker, {**body, "echo": True})
    assert echoed == PARTIAL[-1]["content"] + plain
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in events(worker, "chat/completions",
                                                                                       {**body, "echo": True}))
    assert streamed == echoed


def test_chat_echo_needs_the_answers_role(worker):
    """With a generation prompt the answer is a new assistant message: a user's last message is not
    echoed (vLLM's rule)."""
    body = {"model": "demo", "messages": CHAT, "max_tokens": 3, "temperature": 0}
    assert chat_content(worker, {**body, "echo": True}) == chat_content(worker, body)


def test_chat_prompt_logprobs_score_the_templated_prompt(worker, prompt_oracle):
    """vLLM's chat `prompt_logprobs`: once for the request, at the top level, over the prompt the
    chat template made; against transformers + PEFT."""
    tok = worker.engine.tokenizer
    ids = tok.encode_chat(CHAT)
    body = {"model": "sql", "messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "n": 2}
    r = post(worker, "chat/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    want = prompt_oracle(ids, (("sql", 1.0),))
    assert max(abs(e[str(t)]["logprob"] - w) for e, t, w in zip(got[1:], ids[1:], want)) < logprob_tolerance(worker)
    assert "prompt_logprobs" not in post(worker, "chat/completions", {**body, "prompt_logprobs": None}).json()


def test_chat_prompt_logprobs_are_not_streamed(worker):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1, "stream": True}
    assert "stream" in refused(post(worker, "chat/completions", body), "prompt_logprobs")

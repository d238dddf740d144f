"""Tool calls read out of an answer as it is written (worker/openai/tool_parsers.py): answers built from
known calls with `json.dumps` (any spacing, key order, escapes) give those calls back (checked with
`json.loads`); fed in pieces of every size, a stream sends the same content and calls as the whole
answer reads to, its arguments piece by piece; what is not a call is content."""

from __future__ import annotations

import json
import random

import pytest

from lorafleet.worker.openai.tool_parsers import CallStream, parse

WEATHER = {"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}
ODD = {"name": "wé \"x\"", "arguments": {"q": "}{ ] [ \\\" ;,", "n": [1, {"a": None}], "t": True, "f": -1.5e3}}
CLOCK = {"name": "clock", "arguments": {}}


def call_text(call: dict, key: str = "arguments", rng: random.Random | None = None) -> str:
    """A call object as a model might write it: the keys in either order, compact or spaced."""
    items = [("name", call["name"]), (key, call["arguments"])]
    if rng is not None and rng.random() < 0.5:
        items.reverse()
    seps = (",", ":") if rng is not None and rng.random() < 0.5 else (", ", ": ")
    return json.dumps(dict(items), separators=seps, ensure_ascii=rng is not None and rng.random() < 0.5)


def streamed(fmt: str, text: str, cut: int, forced: str | None = None):
    """(content, [(name, arguments)], entries) fed `cut` characters at a time, with OpenAI's rules
    for putting the entries together checked on the way."""
    stream, content, calls, entries = CallStream(fmt, forced), "", {}, []
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += out[0]
        for e in out[1]:
            entries.append(e)
            if e["index"] not in calls:
                assert e["id"] and e["type"] == "function" and e["function"]["name"], e  # the first names the call
                calls[e["index"]] = [e["function"]["name"], ""]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}, e
            calls[e["index"]][1] += e["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], entries


def check_stream_is_whole(fmt: str, text: str, forced: str | None = None):
    """Every cut gives what `parse` gives; returns that."""
    content, calls = parse(fmt, text, forced)
    want = (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []])
    for cut in (1, 2, 3, 5, 8, 13, len(text) or 1):
        assert streamed(fmt, text, cut, forced)[:2] == want, (fmt, text, cut)
    return want


@pytest.mark.parametrize("seed", range(6))
def test_hermes_calls_come_back(seed):
    rng = random.Random(seed)
    calls = rng.sample([WEATHER, ODD, CLOCK], rng.randint(1, 3))
    text = "Let me look. " + "\n".join(f"<tool_call>\n{call_text(c, rng=rng)}\n</tool_call>" for c in calls)
    if seed % 2:
        text = text[: -len("\n</tool_call>")]  # EOS before the last close
    content, got = check_stream_is_whole("hermes", text)
    assert content == "Let me look. "
    assert [(n, json.loads(a)) for n, a in got] == [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("seed", range(6))
def test_llama3_calls_come_back(seed):
    rng = random.Random(seed)
    calls = rng.sample([WEATHER, ODD, CLOCK], rng.randint(1, 3))
    lead = rng.choice(["", "  ", "<|python_tag|>", " \n<|python_tag|> "])
    text = lead + rng.choice([";", "; ", " ;\n"]).join(call_text(c, rng.choice(["parameters", "arguments"]), rng)
                                                       for c in calls) + rng.choice(["", "\n"])
    content, got = check_stream_is_whole("llama3_json", text)
    assert content == ""
    assert [(n, json.loads(a)) for n, a in got] == [(c["name"], c["arguments"]) for c in calls]


def test_required_and_forced_answers():
    text = "[" + ", ".join(call_text(c, "parameters") for c in (WEATHER, ODD)) + "]"
    content, got = check_stream_is_whole("required", text)
    assert content == "" and [(n, json.loads(a)) for n, a in got] == [("weather", WEATHER["arguments"]),
                                                                      (ODD["name"], ODD["arguments"])]
    args = json.dumps(ODD["arguments"])
    assert check_stream_is_whole("forced", args, "weather") == ("", [("weather", args)])


def test_arguments_go_out_as_they_are_written():
    """One character at a time: the call is named once its name and the start of its arguments are
    in, and every character of the arguments goes out the step it arrives."""
    text = "<tool_call>" + call_text(WEATHER)
    _, _, entries = streamed("hermes", text, 1)
    args = json.dumps(WEATHER["arguments"])
    assert entries[0]["function"] == {"name": "weather", "arguments": "{"}
    assert "".join(e["function"]["arguments"] for e in entries) == args and len(entries) == len(args)
    _, _, entries = streamed("forced", args, 4, "weather")
    assert entries[0]["function"] == {"name": "weather", "arguments": args[:4]}


def test_a_call_cut_short_stays_a_call():
    text = "<tool_call>" + call_text(WEATHER)[:-9]
    assert check_stream_is_whole("hermes", text) == ("", [("weather", json.dumps(WEATHER["arguments"])[:-8])])
    assert check_stream_is_whole("required", '[{"name": "clock", "parameters": {"utc": tr') == (
        "", [("clock", '{"utc": tr')])
    # cut before the arguments began: no call yet, so it is content
    assert check_stream_is_whole("llama3_json", '{"name": "weather", "para') == ('{"name": "weather", "para', [])


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "no call here"),
    ("hermes", "a <tool_c"),  # held while it could open a call, then sent
    ("hermes", "Sure <tool> is a tag."),
    ("hermes", "x <tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>["weather"]</tool_call>'),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("llama3_json", "It is sunny. " + call_text(WEATHER)),
    ("llama3_json", '{"city": "Oslo"}'),
    ("llama3_json", '{"name": "x", "parameters": [1]}'),
    ("llama3_json", "[1, 2]"),
    ("llama3_json", "<|pyth"),
    ("llama3_json", ""),
    ("required", '{"name": "clock"}'),
])
def test_what_is_not_a_call_is_content(fmt, text):
    assert check_stream_is_whole(fmt, text) == (text, [])


def test_content_before_a_call_is_sent_before_it_ends():
    stream = CallStream("hermes")
    assert stream.feed("Sure <tool")[0] == "Sure "  # the tail that could open a call is held
    assert stream.feed("> is a tag. <tool_")[0] == "<tool> is a tag. "
    assert stream.feed('call>{"name": "clock"') == ("", [])
    content, entries = stream.feed("}")
    assert content == "" and entries[0]["function"] == {"name": "clock", "arguments": "{}"}


def test_after_good_calls_a_bad_one_ends_them():
    text = call_text(WEATHER) + "; " + '{"name": 7}; ' + call_text(CLOCK)
    assert check_stream_is_whole("llama3_json", text) == ("", [("weather", json.dumps(WEATHER["arguments"]))])
    text = "<tool_call>" + call_text(CLOCK) + "</tool_call> then <tool_call>oops</tool_call>"
    assert check_stream_is_whole("hermes", text) == ("", [("clock", "{}")])


@pytest.mark.parametrize("text,args", [
    ('<tool_call>{"name": "x", "arguments": {}, 5}</tool_call>', "{}"),
    ('<tool_call>{"name": "x", "arguments": {"a": 1}, "name": 3}', '{"a": 1}'),
])
def test_a_call_that_goes_bad_after_its_arguments_began_stays_a_call(text, args):
    """Streamed, the call went out when its arguments began; read whole, the same (was content)."""
    assert check_stream_is_whole("hermes", text) == ("", [("x", args)])


@pytest.mark.parametrize("seed", range(4))
def test_mistral_calls_come_back(seed):
    """Both of Mistral's forms: `[TOOL_CALLS]` then a JSON array (with the `id` key its models may
    add), or `[TOOL_CALLS]name[ARGS]{...}` a call; ids of 9 letters and digits, as its templates want."""
    rng = random.Random(seed)
    calls = rng.sample([WEATHER, ODD, CLOCK], rng.randint(1, 3))
    if seed % 2:
        text = "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)
    else:
        text = "[TOOL_CALLS] [" + ", ".join(
            json.dumps({**c, "id": "a1b2c3d4e"}, separators=rng.choice([(",", ":"), (", ", ": ")])) for c in calls) + "]"
    content, got = check_stream_is_whole("mistral", "Checking. " + text)
    assert content == "Checking. "
    assert [(n, json.loads(a)) for n, a in got] == [(c["name"], c["arguments"]) for c in calls]
    ids = [c["id"] for c in parse("mistral", text)[1]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == len(ids)
    assert all(c["id"].startswith("call_") for c in parse("hermes", "<tool_call>" + call_text(CLOCK))[1])


@pytest.mark.parametrize("text", ["[TOOL_CALLS]", "[TOOL_CALLS] {\"name\": \"x\"}", "x [TOOL_CALLS]get\nweather",
                                  "[TOOL_CALLS][ARGS]{}", "[TOOL_CA"])
def test_mistral_what_is_not_a_call_is_content(text):
    assert check_stream_is_whole("mistral", text) == (text, [])


# -- pythonic: [name(key=literal, ...), ...] ----------------------------------------------------------------

PY_CALLS = [WEATHER, {"name": "search.web", "arguments": {"q": "}{ ) ( ] [ \\\" ' ;,", "n": [1, {"a": None}],
                                                           "t": True, "f": -1.5e3, "pair": (1, "x")}}, CLOCK]


def python_call(call: dict, rng: random.Random) -> str:
    """A call as Python source, its values written by `repr` (Python's own literals)."""
    sep = rng.choice([", ", ",", " ,\n  "])
    return f"{call['name']}({sep.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"


def as_json(value):
    return json.loads(json.dumps(value))  # tuples are lists in JSON


@pytest.mark.parametrize("seed", range(6))
def test_pythonic_calls_come_back(seed):
    rng = random.Random(seed)
    calls = rng.sample(PY_CALLS, rng.randint(1, 3))
    text = rng.choice(["[", " [ "]) + rng.choice([", ", ",\n"]).join(python_call(c, rng) for c in calls) + "]"
    content, got = check_stream_is_whole("pythonic", text)
    assert content == ""
    assert [(n, json.loads(a)) for n, a in got] == [(c["name"], as_json(c["arguments"])) for c in calls]


def test_pythonic_arguments_go_out_an_argument_at_a_time():
    _, got, entries = streamed("pythonic", "[weather(city='Oslo', unit=\"C\"), clock()]", 1)
    assert [e["function"]["arguments"] for e in entries] == ['{"city": "Oslo"', ', "unit": "C"}', "{}"]
    assert entries[0]["function"]["name"] == "weather" and entries[2]["function"]["name"] == "clock"
    # cut short: the arguments taken so far; before the first is whole, no call, so content
    assert check_stream_is_whole("pythonic", "[weather(city='Oslo', unit='") == ("", [("weather", '{"city": "Oslo"')])
    assert check_stream_is_whole("pythonic", "[weather(city='Os") == ("[weather(city='Os", [])


@pytest.mark.parametrize("text", [
    "Sure: [weather(city='Oslo')]", "weather(city='Oslo')", "[weather('Oslo')]", "[weather(city=Oslo)]",
    "[weather(city={1, 2})]", "[f(a=float('nan'))]", "[f(a=1e999)]", "[1, 2]", "[]",
    "[weather city]", "[3x(a=1)]", "[weather(city='Oslo']", "",
])
def test_pythonic_what_is_not_a_call_is_content(text):
    assert check_stream_is_whole("pythonic", text) == (text, [])


def test_pythonic_after_good_calls_a_bad_one_ends_them():
    assert check_stream_is_whole("pythonic", "[clock(), weather(Oslo), clock()]") == ("", [("clock", "{}")])
    assert check_stream_is_whole("pythonic", "[clock(utc=True,)] and more") == ("", [("clock", '{"utc": true}')])
    # a bad argument after a good one: the call as far as it read (it went out with that argument)
    assert check_stream_is_whole("pythonic", "[f(a=1, a=2)]") == ("", [("f", '{"a": 1')])

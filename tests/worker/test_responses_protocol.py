"""The Responses API request read as a chat request (worker/openai/responses_protocol.py), torch-free:
input items as chat messages, flat function tools as chat's nested ones, text.format as
response_format, include's logprobs as chat's; extras passed on; what it cannot be is a 400 naming
the field (served 400s: tests/worker/test_responses_api.py)."""

from __future__ import annotations

import pytest

from lorafleet.worker.openai.protocol import UnsupportedField
from lorafleet.worker.openai.responses_protocol import BadField, ResponsesRequest


def request(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "demo", **body})


def chat_of(**body):
    return request(**body).chat_request()


def test_a_string_input_is_one_user_turn_after_the_instructions():
    body = dict(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    c = chat_of(**body)
    assert request(**body).messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (c.max_completion_tokens, c.temperature, c.top_p, c.logprobs, c.n) == (7, 0.5, 0.9, False, 1)


def test_items_are_the_turns():
    call = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"}
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules. "}, {"type": "input_text", "text": "More."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        call, {**call, "call_id": "c2", "name": "clock"},
        {"type": "function_call_output", "call_id": "c1", "output": "4 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "c3", "name": "clock", "arguments": "{}"},
    ]
    fn = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
    assert request(input=items).messages() == [
        {"role": "developer", "content": "Rules. More."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", **fn}, {"id": "c2", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
    ]


def test_tools_choice_format_and_logprobs_in_chats_names():
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True, "description": None}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = chat_of(input="x", tools=[tool], tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
                include=["message.output_text.logprobs"], top_logprobs=3)
    assert c.tools == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": True}}]
    assert c.tool_choice == {"type": "function", "function": {"name": "weather"}} and c.parallel_tool_calls is False
    assert c.response_format == {
        "type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    assert (c.logprobs, c.top_logprobs) == (True, 3)
    assert chat_of(input="x", text={"format": {"type": "json_object"}}).response_format == {"type": "json_object"}
    assert chat_of(input="x", text={"format": {"type": "text"}}).response_format is None
    assert chat_of(input="x", tool_choice="required").tool_choice == "required"


def test_vllms_extra_fields_pass_on():
    c = chat_of(input="x", seed=3, top_k=5, stop=["\n"], lora_adapters=[{"name": "sql", "scale": 0.5}],
                guided_choice=["a", "b"], reasoning={"effort": "low"}, metadata={"k": "v"}, store=True)
    assert (c.seed, c.top_k, c.stop, c.guided_choice) == (3, 5, ["\n"], ["a", "b"])
    assert c.lora_adapters[0].name == "sql"


def test_the_response_echoes_the_settings():
    r = ResponsesRequest.model_validate({"input": "x", "store": True, "metadata": {"k": "v"}, "tool_choice": "none"})
    echo = r.echo()
    assert (echo["store"], echo["metadata"], echo["tool_choice"], echo["temperature"], echo["truncation"]) == (
        False, {"k": "v"}, "none", 1.0, "disabled")
    assert echo["text"] == {"format": {"type": "text"}} and echo["parallel_tool_calls"] is True


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"), ({"max_tokens": 3}, "max_tokens"), ({"logprobs": True}, "logprobs"),
    ({"prompt": {"id": "p"}}, "prompt"), ({"background": True}, "background"), ({"truncation": "auto"}, "truncation"),
    ({"include": ["computer_call_output.output.image_url"]}, "include"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "file_search"}]}, "tools.0"), ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tool_choice": {"type": "mcp"}}, "tool_choice"), ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [{"type": "web_search_call"}]}, "input.0"), ({"input": [{"type": "item_reference", "id": "i"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": []}, "input"), ({"seed": "x"}, "seed"),
])
def test_what_it_cannot_be_names_the_field(body, param):
    with pytest.raises((BadField, UnsupportedField)) as err:
        chat_of(**{"input": "x", **body})
    assert err.value.param == param, err.value


def test_include_that_asks_for_nothing_is_taken():
    assert chat_of(input="x", include=["reasoning.encrypted_content"]).logprobs is False

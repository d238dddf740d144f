"""`check_fields`: the router refuses what the worker would (its wording), and caps lengths and counts."""

from __future__ import annotations

import pytest

from lorafleet.protocol import MAX_TOKENS_ZERO
from lorafleet.router.request_fields import check_fields
from lorafleet.router.settings import RouterSettings

SETTINGS = RouterSettings(max_tokens_cap=8192, max_n=8)
COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"


@pytest.mark.parametrize(
    ("payload", "path", "expected"),
    [
        ({}, COMPLETIONS, None),
        ({"max_tokens": 1, "n": 1, "stream": True}, COMPLETIONS, None),
        ({"max_tokens": None, "max_completion_tokens": None}, CHAT, None),
        ({"max_tokens": 0}, COMPLETIONS, ("max_tokens", MAX_TOKENS_ZERO)),
        ({"max_tokens": 0, "echo": True}, COMPLETIONS, None),  # completions' echo alone
        ({"max_tokens": 0, "echo": False}, COMPLETIONS, ("max_tokens", MAX_TOKENS_ZERO)),
        ({"max_tokens": 0, "echo": "true"}, COMPLETIONS, None),  # not a boolean: the worker refuses echo itself
        ({"max_tokens": 0, "echo": True}, CHAT, ("max_tokens", "max_tokens: Input should be greater than or equal to 1")),
        ({"max_tokens": True}, COMPLETIONS, ("max_tokens", "max_tokens: Input should be a valid integer")),
        ({"max_tokens": "5"}, COMPLETIONS, ("max_tokens", "max_tokens: Input should be a valid integer")),
        (
            {"max_tokens": 8193},
            COMPLETIONS,
            ("max_tokens", "max_tokens: Input should be less than or equal to 8192"),
        ),
        (
            {"max_completion_tokens": 0},
            CHAT,
            ("max_completion_tokens", "max_completion_tokens: Input should be greater than or equal to 1"),
        ),
        ({"max_completion_tokens": 0}, COMPLETIONS, None),  # completions has no such field: the worker ignores it
        ({"n": False}, COMPLETIONS, ("n", "n: Input should be a valid integer")),
        ({"n": None, "stream": None, "max_tokens": None}, COMPLETIONS, None),  # null: not given (OpenAI's rule)
        ({"n": None, "stream": None, "max_completion_tokens": None}, CHAT, None),
        ({"n": 0}, COMPLETIONS, ("n", "n: Input should be greater than or equal to 1")),
        ({"n": 8}, COMPLETIONS, None),
        ({"n": 9}, COMPLETIONS, ("n", "n: Input should be less than or equal to 8")),
        ({"stream": "false"}, COMPLETIONS, ("stream", "stream: Input should be a valid boolean")),
        ({"stream": 0}, COMPLETIONS, ("stream", "stream: Input should be a valid boolean")),
        # The Responses API's one length field, capped as the others; chat's names are the worker's 400.
        ({"max_output_tokens": 8192, "max_tokens": 0, "n": 99}, RESPONSES, None),
        ({"max_output_tokens": 0}, RESPONSES, ("max_output_tokens", "max_output_tokens: Input should be greater than or equal to 1")),
        ({"max_output_tokens": 8193}, RESPONSES, ("max_output_tokens", "max_output_tokens: Input should be less than or equal to 8192")),
        ({"max_output_tokens": 1.5}, RESPONSES, ("max_output_tokens", "max_output_tokens: Input should be a valid integer")),
        ({"max_output_tokens": 0}, CHAT, None),  # not chat's field
        ({"stream": "yes"}, RESPONSES, ("stream", "stream: Input should be a valid boolean")),
    ],
)
def test_check_fields_refuses_what_the_worker_refuses(payload, path, expected):
    assert check_fields(payload, SETTINGS, path) == expected


@pytest.mark.parametrize("body", [
    b'{"model": "a", "prompt": "\xc3\xa9"}', b"{}", b"{", b"{ ", b'{"a": 1} x', b"\xef\xbb\xbf{}", b"[1]", b"1",
    '{"a": 1}'.encode("utf-16-le"), '{"a": 1}'.encode("utf-16"), b'{"a": "\xff"}', b'{"a": "\\ud800"}',
    b'{"a": "\xed\xa0\x80"}', b'{"a": 1} \r\n\t', b'{"a": 1}\x0c', b'{"a": 1}{}', b"{\n}",
])
def test_json_value_reads_a_body_as_json_loads_does(body: bytes) -> None:
    import json

    from lorafleet.router.generate import json_value

    try:
        expected: object = json.loads(body)
    except ValueError as exc:
        expected = (type(exc), str(exc))
    try:
        got: object = json_value(body)
    except ValueError as exc:
        got = (type(exc), str(exc))
    assert got == expected

"""`lorafleet worker`'s flags: settings the worker cannot serve are refused at start-up, with why."""

from __future__ import annotations

import json

import pytest

from lorafleet.worker.config import ConfigError
from lorafleet.worker.server.cli import build_parser, main, settings_from_args


@pytest.mark.parametrize("served", ["demo", None], ids=["served-name", "model-path"])
def test_a_start_up_adapter_named_after_the_base_model_is_refused(demo_model, demo_adapters, served, capsys):
    """`model: <base name>` means the base, so such an adapter could never be asked for."""
    base = served or str(demo_model)
    argv = ["--model", str(demo_model), "--lora-modules", f"sql={demo_adapters['sql']}",
            f"{base}={demo_adapters['poem']}"]
    argv += ["--served-model-name", served] if served else []
    with pytest.raises(ConfigError, match="--lora-modules"):
        settings_from_args(build_parser().parse_args(argv))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{base!r}" in err and "base model" in err


def test_lora_modules_take_vllms_json_form_too(demo_model, demo_adapters):
    argv = ["--model", str(demo_model), "--lora-modules", f"sql={demo_adapters['sql']}",
            json.dumps({"name": "poem", "path": str(demo_adapters["poem"]), "base_model_name": "demo"}),
            "--lora-modules", json.dumps({"name": "code", "path": str(demo_adapters["code"])})]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.lora_modules == (("sql", str(demo_adapters["sql"])), ("poem", str(demo_adapters["poem"])),
                                     ("code", str(demo_adapters["code"])))


@pytest.mark.parametrize("value, message", [
    ("sql", "expects name=path or vLLM's JSON form"),
    ('{"name": "sql"', "is not valid JSON"),
    ('{"name": "sql"}', 'expects {"name": ..., "path": ...}'),
    ('{"name": "sql", "path": "/a", "rank": 8}', "unknown key(s) rank"),
    ('{"name": 5, "path": "/a"}', 'expects {"name": ..., "path": ...}'),
])
def test_bad_lora_modules_say_what_is_expected(demo_model, value, message, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--model", str(demo_model), "--lora-modules", value])
    assert info.value.code == 2
    assert message in capsys.readouterr().err

"""common/event_loop.py: the worker's event loop by name (LORAFLEET_WORKER_LOOP)."""

import asyncio

import pytest

from lorafleet.event_loop import loop_factory


def test_asyncio_is_asyncios_default():
    assert loop_factory("asyncio") is None


def test_uvloop_makes_uvloops_loop():
    uvloop = pytest.importorskip("uvloop")
    factory = loop_factory("uvloop")
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)


def test_an_unknown_loop_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'trio' is not one of asyncio, uvloop"):
        loop_factory("trio")


def test_the_worker_cli_refuses_an_unknown_loop(monkeypatch, demo_model, capsys):
    from lorafleet.worker import envs
    from lorafleet.worker.server import cli

    monkeypatch.setattr(envs, "WORKER_LOOP", "trio")
    assert cli.main(["--model", str(demo_model), "--port", "1"]) == 2
    assert "LORAFLEET_WORKER_LOOP: event loop 'trio' is not one of" in capsys.readouterr().err

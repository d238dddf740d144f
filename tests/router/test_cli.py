"""`lorafleet router` flags → settings."""

from __future__ import annotations

import argparse
import io
import sys

import pytest

from lorafleet.router.cli import build_parser, main, parse_lora_modules, settings_from_args
from lorafleet.router.discovery import Endpoint, pods_to_endpoints
from lorafleet.router.tenants import hash_api_key


def test_flags_to_settings(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = build_parser().parse_args(
        [
            "--port",
            "9000",
            "--worker",
            "http://a:1",
            "--worker",
            "http://b:2",
            "--lora-modules",
            "x=/p/x",
            "y=/p/y",
        ]
        + ["--admin-token-file", str(token), "--redis-url", "redis://r:6379/0", "--policy", "chwbl"]
    )
    s = settings_from_args(args)
    assert (
        s.port == 9000
        and s.workers == ("http://a:1", "http://b:2")
        and dict(s.lora_modules) == {"x": "/p/x", "y": "/p/y"}
    )
    assert (
        s.admin_token_file == token
        and s.admin_token_dir is None
        and s.redis_url == "redis://r:6379/0"
        and s.policy == "chwbl"
        and s.tenants_file is None
    )


@pytest.mark.parametrize("bad", ["x", "=p", "x="])
def test_bad_lora_modules(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_modules([bad])


def test_static_needs_workers(capsys):
    assert main([]) == 2
    assert "--worker" in capsys.readouterr().err


def test_hash_api_key(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("my-key\n"))
    assert main(["--hash-api-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key("my-key")


def test_admin_flags(tmp_path):
    (tmp_path / "tokens").mkdir()
    args = build_parser().parse_args(
        [
            "--worker",
            "http://h:8000,admin=http://h:8001,pool=p",
            "--admin-token-dir",
            str(tmp_path / "tokens"),
        ]
        + ["--discovery", "kubernetes", "--k8s-admin-port", "8001"]
    )
    s = settings_from_args(args)
    assert s.workers == ("http://h:8000,admin=http://h:8001,pool=p",)
    assert s.admin_token_dir == tmp_path / "tokens" and s.k8s_admin_port == 8001
    assert build_parser().parse_args([]).k8s_admin_port is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--worker", "http://h:1,admin=h:2"], "admin="),
        (["--worker", "http://h:1,color=red"], "options are"),
        (["--worker", "http://h:1", "--admin-token-file", "/nonexistent/token"], "/nonexistent/token"),
        (["--worker", "http://h:1", "--admin-token-dir", "/nonexistent"], "/nonexistent"),
    ],
)
def test_bad_admin_flags_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_pods_to_endpoints():
    ready = {"conditions": [{"type": "Ready", "status": "True"}], "podIP": "10.0.0.1"}
    pods = {
        "items": [
            {"metadata": {"name": "w-0"}, "status": ready},
            {
                "metadata": {"name": "w-1"},
                "status": {"conditions": [{"type": "Ready", "status": "False"}], "podIP": "10.0.0.2"},
            },
            {"metadata": {"name": "w-2", "deletionTimestamp": "x"}, "status": ready},
            {"metadata": {"name": "w-3"}, "status": {"conditions": []}},
        ]
    }
    assert pods_to_endpoints(pods, 8000) == [Endpoint("w-0", "http://10.0.0.1:8000", "http://10.0.0.1:8000")]

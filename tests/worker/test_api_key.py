"""vLLM's `--api-key` on our worker: what it guards and what it leaves open, as vLLM 0.32's middleware
does (tests/vllm/test_flag_parity.py holds the two side by side); the admin routes on the same port
keep the admin token."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from tests.worker.worker_harness import PROMPT, RunningWorker, auth, worker_settings

KEYS = ("first-key", "second-key")


@pytest.fixture(scope="module")
def guarded(demo_model, demo_adapters, tmp_path_factory):
    token = tmp_path_factory.mktemp("admin") / "token"
    token.write_text("s3cret-admin-token")
    settings = replace(worker_settings(demo_model, demo_adapters, token_file=token), api_keys=KEYS)
    w = RunningWorker(settings).start()
    yield w
    w.stop()


@pytest.mark.parametrize("header, status", [
    (None, 401), ("Bearer wrong", 401), ("Basic first-key", 401), ("Bearer  first-key", 401),
    ("Bearer first-key", 200), ("bearer second-key", 200),
])
def test_v1_needs_one_of_the_keys(guarded, header, status):
    headers = {"Authorization": header} if header else {}
    r = httpx.get(f"{guarded.url}/v1/models", headers=headers, timeout=10)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
        assert "--api-key" in r.json()["error"]["message"]


def test_generation_is_guarded_and_served_with_a_key(guarded):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=30).status_code == 401
    r = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth("second-key"), timeout=30)
    assert r.status_code == 200, r.text


def test_probes_metrics_and_tokenize_stay_open(guarded):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{guarded.url}{path}", timeout=10).status_code == 200, path
    r = httpx.post(f"{guarded.url}/tokenize", json={"model": "demo", "prompt": "hi"}, timeout=10)
    assert r.status_code == 200
    assert httpx.options(f"{guarded.url}/v1/models", timeout=10).status_code != 401  # CORS preflights


def test_the_admin_routes_take_the_admin_token_not_the_key(guarded):
    assert httpx.get(f"{guarded.url}/v1/adapters", headers=auth(), timeout=10).status_code == 200
    assert httpx.get(f"{guarded.url}/v1/adapters", headers=auth("first-key"), timeout=10).status_code == 401

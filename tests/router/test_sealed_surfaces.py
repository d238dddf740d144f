"""What the router tells a caller who is not entitled to know: /metrics shows no tenant names
without its token, /ready no worker addresses, a 503 no file paths, /v1/models only what the
calling tenant may use."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from lorafleet.router.tenants import hash_api_key
from tests.router.conftest import RouterThread, router_settings, start_workers

TENANTS = {
    "tenants": [
        {"name": "acme-confidential", "api_key_sha256": hash_api_key("acme-key"), "models": ["base-one"]},
        {"name": "beta-confidential", "api_key_sha256": hash_api_key("beta-key")},
    ]
}


@pytest.fixture
def mixed_workers():
    """Two base models: base-one serves adapter a, base-two serves b."""
    workers = start_workers([
        {"name": "w0", "model": "base-one", "lora_modules": {"a": "/adapters/a"}},
        {"name": "w1", "model": "base-two", "lora_modules": {"b": "/adapters/b"}},
    ])
    yield workers
    for w in workers:
        w.kill()


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    return path


def key(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


def complete(router: RouterThread, model: str, api_key: str) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                      headers=key(api_key), timeout=30)


def test_metrics_without_token_show_no_tenant_names(mixed_workers, tenants_file):
    settings = router_settings(mixed_workers, tenants_file=tenants_file, lora_modules={})
    with RouterThread(settings) as router:
        assert complete(router, "a", "acme-key").status_code == 200
        text = httpx.get(router.url + "/metrics").text
        assert "lorafleet_router_requests_total" in text  # an unauthenticated scraper still works
        assert "acme-confidential" not in text and "beta-confidential" not in text
        assert 'tenant="t-' in text


def test_metrics_with_token_need_it_and_show_names(mixed_workers, tenants_file, tmp_path):
    token = tmp_path / "metrics-token"
    token.write_text("scrape-me\n")
    settings = router_settings(mixed_workers, tenants_file=tenants_file, lora_modules={}, metrics_token_file=token)
    with RouterThread(settings) as router:
        assert complete(router, "a", "acme-key").status_code == 200
        for headers in ({}, key("wrong"), key("acme-key"), {"Authorization": "Basic scrape-me"}):
            r = httpx.get(router.url + "/metrics", headers=headers)
            assert r.status_code == 401, r.text
            assert "lorafleet_router" not in r.text
        r = httpx.get(router.url + "/metrics", headers=key("scrape-me"))
        assert r.status_code == 200 and 'tenant="acme-confidential"' in r.text


def test_ready_lists_no_worker_addresses(mixed_workers):
    with RouterThread(router_settings(mixed_workers, lora_modules={})) as router:
        r = httpx.get(router.url + "/ready")
        assert r.status_code == 200 and r.json()["replicas"] == 2
        for w in mixed_workers:
            assert str(w.port) not in r.text and w.cfg.name not in r.text


def test_models_lists_only_what_the_tenant_may_use(mixed_workers, tenants_file):
    settings = router_settings(mixed_workers, tenants_file=tenants_file, lora_modules={})
    with RouterThread(settings) as router:
        acme = {m["id"]: m for m in httpx.get(router.url + "/v1/models", headers=key("acme-key")).json()["data"]}
        beta = {m["id"]: m for m in httpx.get(router.url + "/v1/models", headers=key("beta-key")).json()["data"]}
        assert set(acme) == {"base-one", "a"}  # not b: it serves on base-two, which acme may not use
        assert acme["a"]["parent"] == "base-one"
        assert set(beta) == {"base-one", "base-two", "a", "b"}
        assert complete(router, "b", "acme-key").status_code == 404  # the listing matches what is allowed


def test_503_names_no_file_paths(mixed_workers):
    settings = router_settings(mixed_workers, lora_modules={"broken": "/refuse/secret-dir/broken"})
    settings = replace(settings, max_attempts=1)
    with RouterThread(settings) as router:
        r = complete(router, "broken", "any")
        assert r.status_code == 503, r.text
        assert "/refuse" not in r.text and "secret-dir" not in r.text and "adapter_config" not in r.text
        assert "HTTP 400" in r.text and "invalid_config" in r.text  # still says what happened


def test_tenant_labels_prints_the_metrics_mapping(tenants_file, capsys):
    from lorafleet.router.cli import main
    from lorafleet.router.tenants import TenantRegistry

    assert main(["--tenants-file", str(tenants_file), "--tenant-labels"]) == 0
    rows = dict(line.split("\t")[::-1] for line in capsys.readouterr().out.splitlines())
    assert set(rows) == {"acme-confidential", "beta-confidential"}
    assert rows == TenantRegistry.from_file(tenants_file).labels()
    assert all(label.startswith("t-") and len(label) == 14 for label in rows.values())
    assert len(set(rows.values())) == 2

"""The admin API authenticates before it reads the body: without the token, a malformed, empty or
oversized body gets the same 401 as a good one, so nothing about the API is learned without it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lorafleet.worker.server.app import create_app
from lorafleet.worker.server.settings import WorkerSettings

TOKEN = "s3cret-admin-token"

BODIES = {
    "good": {"json": {"lora_name": "x", "lora_path": "x"}},
    "not_json": {"content": b"{not json", "headers": {"content-type": "application/json"}},
    "wrong_type": {"json": {"lora_name": 7, "lora_path": ["a"]}},
    "missing_fields": {"json": {}},
    "empty": {"content": b"", "headers": {"content-type": "application/json"}},
    "form": {"content": b"a=b", "headers": {"content-type": "application/x-www-form-urlencoded"}},
}
PATHS = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    token = tmp_path_factory.mktemp("tok") / "token"
    token.write_text(TOKEN)
    app = create_app(WorkerSettings(model="/nonexistent-model", admin_token_file=str(token)))
    return TestClient(app)  # no lifespan: the model never loads, the admin routes still answer


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("body", list(BODIES))
@pytest.mark.parametrize("cred", [None, "Bearer wrong", "Basic " + TOKEN])
def test_unauthenticated_gets_401_whatever_the_body(client, path, body, cred):
    kw = dict(BODIES[body])
    headers = dict(kw.pop("headers", {}))
    if cred is not None:
        headers["authorization"] = cred
    r = client.post(path, headers=headers, **kw)
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers.get("www-authenticate") == "Bearer"
    assert "lora_name" not in r.text and "JSON" not in r.text  # nothing about the body's shape


def test_authenticated_bad_body_still_gets_400(client):
    r = client.post(PATHS[0], content=b"{not json", headers={"content-type": "application/json",
                                                           "authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400, r.text


def test_unauthenticated_inventory_401(client):
    assert client.get("/v1/adapters").status_code == 401

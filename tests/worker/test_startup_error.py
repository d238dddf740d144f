"""A worker whose engine cannot start says so in its 503s without naming files on its machine."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from lorafleet.worker.server.app import create_app
from lorafleet.worker.server.settings import WorkerSettings


def test_engine_failure_503_names_no_paths(tmp_path):
    missing = tmp_path / "secret-models" / "llama"
    app = create_app(WorkerSettings(model=str(missing)))
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while app.state.runtime.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.runtime.error is not None
        for r in (client.get("/ready"), client.get("/health"),
                  client.post("/v1/completions", json={"model": "x", "prompt": "hi"})):
            assert r.status_code == 503, r.text
            assert "secret-models" not in r.text and str(tmp_path) not in r.text
            assert "failed to start" in r.text

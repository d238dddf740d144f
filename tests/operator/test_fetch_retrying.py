"""A remote adapter whose fetch keeps failing transiently (a wrong endpoint, a store down) says so
in its Ready condition: reason FetchRetrying, the worker's reason and a message with no path of the
worker's machine and no credential; the condition goes back to Loaded once a load takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lorafleet.operator.status import AdapterObservation, adapter_conditions, adapter_phase
from lorafleet.operator.worker_client import LoadRefused, WorkerBusy, WorkerUnavailable, fetch_retry
from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet, fake_worker_factory
from tests.operator.test_e2e import adapter_manifest, apply, pool_manifest, status

KEY = "AKIA" + "Q" * 16
WORKER_MESSAGE = (f"adapter source s3://adapters/team/sql/: the store did not answer (EndpointConnectionError) "
                  f"while writing /var/cache/lorafleet/adapters/.partial-s3-ab12/adapter_model.safetensors "
                  f"via https://{KEY}:secret@minio.internal:9000/adapters (gave up after 5 attempts)")


def test_fetch_errors_the_worker_retries_are_told_safely() -> None:
    reason, message = fetch_retry(WorkerUnavailable("load sql: 503 ...", "unavailable", WORKER_MESSAGE))
    assert reason == "unavailable"
    assert "s3://adapters/team/sql/" in message and "EndpointConnectionError" in message
    assert "gave up after 5 attempts" in message
    assert "/var/cache" not in message and ".partial" not in message and "<path>" in message
    assert KEY not in message and "secret" not in message
    # Other errors are not fetch retries: a worker down, busy, or a refusal.
    assert fetch_retry(WorkerUnavailable("connect failed")) is None
    assert fetch_retry(WorkerBusy("in use", "in_use", "requests in flight")) is None
    assert fetch_retry(LoadRefused(400, "rank", "bad_rank")) is None  # type: ignore[arg-type]
    assert fetch_retry(WorkerUnavailable("x", "unavailable", "y" * 2000))[1].endswith("...")


@pytest.mark.parametrize(("ready", "phase", "reason"), [(0, "Loading", "FetchRetrying"),
                                                        (1, "Loading", "FetchRetrying"),
                                                        (2, "Ready", "Loaded")])
def test_the_ready_condition_tells_the_retried_fetch(ready: int, phase: str, reason: str) -> None:
    obs = AdapterObservation(1, desired=2, placed=2, ready=ready, loading=True,
                             fetch_retrying=("unavailable", "the store did not answer"))
    assert adapter_phase(obs) == phase
    cond = next(c for c in adapter_conditions(obs) if c.type == "Ready")
    assert cond.reason == reason
    if reason == "FetchRetrying":
        assert cond.message == (f"{ready}/2 replicas loaded; fetching the source failed (unavailable), retrying: "
                                "the store did not answer")


async def test_a_fetch_that_keeps_failing_shows_in_the_status_until_it_loads(
    api: PatchedEmulator, kubectl: Kubectl, operator: OperatorRunner, tmp_path: Path,
) -> None:
    faults: dict[str, tuple[int, str, str]] = {"sql": (503, WORKER_MESSAGE, "unavailable")}

    async def factory(*args: Any) -> Any:
        worker = await fake_worker_factory(*args)
        worker.state.load_faults = faults  # every worker fails the fetch alike, until the fault goes
        return worker

    write_adapter(tmp_path, "sql")
    write_adapter(tmp_path, "poem")
    async with Kubelet(api, worker_factory=factory):
        await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=2), adapter_manifest("sql"),
                    adapter_manifest("poem"))

        def ready_condition(name: str) -> dict[str, Any]:
            return next((c for c in status(api, name).get("conditions", []) if c["type"] == "Ready"), {})

        await eventually(lambda: ready_condition("sql").get("reason") == "FetchRetrying", timeout=20)
        cond = ready_condition("sql")
        assert cond["status"] == "False" and status(api, "sql")["phase"] in ("Loading", "Pending")
        assert "(unavailable)" in cond["message"] and "EndpointConnectionError" in cond["message"]
        assert "/var/cache" not in cond["message"] and KEY not in cond["message"]
        await eventually(lambda: status(api, "poem").get("phase") == "Ready")  # the others load meanwhile
        faults.clear()  # the endpoint fixed: the next round's load takes
        await eventually(lambda: status(api, "sql").get("phase") == "Ready", timeout=20)
        assert ready_condition("sql")["reason"] == "Loaded"


async def test_a_real_workers_answer_to_a_wrong_endpoint_is_a_fetch_retry(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's own 503 for a store it cannot reach (nothing listens on the endpoint), as the
    operator's client reads it: a fetch retry with the worker's reason and no local path."""
    pytest.importorskip("boto3")
    import socket

    from lorafleet.operator.worker_client import WorkerClient
    from lorafleet.worker.lora.fetch import AdapterFetcher
    from tests.worker.worker_harness import TOKEN, RunningWorker, worker_settings

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "op52-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    root = tmp_path / "root"
    root.mkdir()
    worker = RunningWorker(worker_settings(demo_model, {}, token_file=token, adapter_root=root))
    worker.runtime.fetcher = AdapterFetcher(tmp_path / "cache", attempts=2, backoff_s=0.01)
    worker.start()
    client = WorkerClient.create(timeout_s=60)
    try:
        with pytest.raises(WorkerUnavailable) as info:
            await client.load(worker.admin_url, TOKEN, "sql", "s3://adapters/team/sql")
    finally:
        await client.close()
        worker.stop()
    reason, message = fetch_retry(info.value)
    assert reason == "unavailable" and "s3://adapters/team/sql" in message, message
    assert "did not answer (EndpointConnectionError)" in message, message
    assert str(tmp_path) not in message and KEY not in message and "op52-secret-value" not in message

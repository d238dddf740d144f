"""`WorkerClient` against the real worker app (demo model, real uvicorn) and the fake worker.

What the operator relies on: a load or unload counts only once the inventory agrees (a 200 is not
trusted), a bad adapter is a permanent `LoadRefused`, and anything the worker or the network may
get over (connect errors, 5xx, 401 while a token rotates) is a transient `WorkerUnavailable`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.local.process_group import free_port
from lorafleet.operator.worker_client import (
    LoadRefused,
    NotVerified,
    WorkerBusy,
    WorkerClient,
    WorkerError,
    WorkerUnavailable,
    resident,
)
from tests.operator.fake_worker import FakeWorkerState, create_app, write_adapter
from tests.worker.worker_harness import TOKEN, RunningWorker, worker_settings


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, demo_adapters: dict[str, Path]) -> Path:
    root = tmp_path_factory.mktemp("client") / "adapters"
    for name in ("sql", "chat", "code"):
        shutil.copytree(demo_adapters[name], root / name)
    shutil.copytree(demo_adapters["sql"], root / "dora")
    config = json.loads((root / "dora" / "adapter_config.json").read_text())
    (root / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return root


@pytest.fixture(scope="module")
def real_worker(demo_model: Path, adapter_root: Path) -> Iterator[RunningWorker]:
    token_file = adapter_root.parent / "token"
    token_file.write_text(TOKEN + "\n")
    settings = worker_settings(demo_model, {}, token_file=token_file, adapter_root=adapter_root,
                               admin_port=True, max_lora_rank=16)  # the demo `code` adapter has rank 32
    worker = RunningWorker(settings).start()
    yield worker
    worker.stop()


@pytest.fixture
async def client() -> AsyncIterator[WorkerClient]:
    c = WorkerClient.create(timeout_s=5.0)
    yield c
    await c.close()


def in_process(state: FakeWorkerState) -> WorkerClient:
    """The fake worker's app called in-process (no socket)."""
    return WorkerClient(httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state))))


# ---- the real worker ---------------------------------------------------------------------------


async def test_load_is_verified_by_the_inventory(client: WorkerClient, real_worker: RunningWorker,
                                                 adapter_root: Path) -> None:
    inv = await client.load(real_worker.admin_url, TOKEN, "sql", str(adapter_root / "sql"))
    assert "sql" in resident(inv)
    info = next(a for a in inv.adapters if a.name == "sql")
    assert info.rank == 8 and info.digest.startswith("sha256:")
    again = await client.load(real_worker.admin_url, TOKEN, "sql", str(adapter_root / "sql"))  # idempotent
    assert resident(again) == resident(inv)
    assert "sql" in resident(await client.inventory(real_worker.admin_url, TOKEN))


async def test_unload_is_verified_and_unloading_an_absent_adapter_is_fine(
    client: WorkerClient, real_worker: RunningWorker, adapter_root: Path
) -> None:
    await client.load(real_worker.admin_url, TOKEN, "chat", str(adapter_root / "chat"))
    inv = await client.unload(real_worker.admin_url, TOKEN, "chat")
    assert "chat" not in resident(inv)
    inv = await client.unload(real_worker.admin_url, TOKEN, "chat")  # the worker answers 404: already gone
    assert "chat" not in resident(inv)


@pytest.mark.parametrize(("name", "source", "status", "reason", "words"), [
    ("code", "code", 400, "LoadRefused", "rank 32 exceeds"),
    ("dora", "dora", 400, "LoadRefused", "DoRA"),
    ("missing", "no-such-folder", 400, "SourceNotFound", "does not exist"),  # no server path in the message
    ("outside", "../token", 400, "LoadRefused", "outside the adapter root"),
    ("sql", "chat", 409, "ContentConflict", "sql"),  # the name is taken by different weights
])
async def test_a_refused_load_is_permanent(client: WorkerClient, real_worker: RunningWorker, adapter_root: Path,
                                           name: str, source: str, status: int, reason: str, words: str) -> None:
    await client.load(real_worker.admin_url, TOKEN, "sql", str(adapter_root / "sql"))
    with pytest.raises(LoadRefused) as caught:
        await client.load(real_worker.admin_url, TOKEN, name, str(adapter_root / source))
    assert (caught.value.status, caught.value.reason) == (status, reason)
    assert words in caught.value.message
    assert name == "sql" or name not in resident(await client.inventory(real_worker.admin_url, TOKEN))


async def test_a_load_in_place_replaces_other_content(client: WorkerClient, real_worker: RunningWorker,
                                                      adapter_root: Path) -> None:
    """What the operator does when a LoraAdapter's source changes: the name keeps serving, with the
    new weights, without an unload in between."""
    await client.load(real_worker.admin_url, TOKEN, "swap", str(adapter_root / "sql"))
    before = next(a for a in (await client.inventory(real_worker.admin_url, TOKEN)).adapters if a.name == "swap")
    inv = await client.load(real_worker.admin_url, TOKEN, "swap", str(adapter_root / "chat"), inplace=True)
    after = next(a for a in inv.adapters if a.name == "swap")
    assert after.digest != before.digest and after.path.endswith("/chat")
    await client.unload(real_worker.admin_url, TOKEN, "swap")


async def test_a_wrong_token_is_transient_not_a_bad_adapter(client: WorkerClient, real_worker: RunningWorker,
                                                            adapter_root: Path) -> None:
    # 401 says nothing about the adapter: the pool's Secret and the pod's mounted copy disagree (a
    # rotation, a pod started before the Secret changed). Failing the adapter would stick until its
    # spec changes; the operator retries with backoff instead, and the pod restart fixes it.
    for call in (client.inventory(real_worker.admin_url, "wrong"),
                 client.load(real_worker.admin_url, "wrong", "chat", str(adapter_root / "chat")),
                 client.unload(real_worker.admin_url, "wrong", "chat")):
        with pytest.raises(WorkerUnavailable, match="401"):
            await call
    assert "chat" not in resident(await client.inventory(real_worker.admin_url, TOKEN))


async def test_a_worker_that_is_not_listening_is_transient(client: WorkerClient, adapter_root: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for call in (client.inventory(url, TOKEN), client.load(url, TOKEN, "sql", str(adapter_root / "sql")),
                 client.unload(url, TOKEN, "sql")):
        with pytest.raises(WorkerUnavailable, match="ConnectError"):
            await call


# ---- misbehaving workers (the fake worker, or a scripted transport) ----------------------------


async def test_an_unload_that_answers_200_but_keeps_the_adapter_is_not_verified(tmp_path: Path) -> None:
    write_adapter(tmp_path, "a1")
    state = FakeWorkerState(token=TOKEN, adapter_root=tmp_path, sticky_unload=True)
    client = in_process(state)
    await client.load("http://w", TOKEN, "a1", str(tmp_path / "a1"))
    with pytest.raises(NotVerified, match="still resident"):
        await client.unload("http://w", TOKEN, "a1")
    assert ("unload", "a1") in state.calls and "a1" in state.adapters
    # Not a refusal: the reconciler keeps it as "loaded there" and tries again next round.
    assert issubclass(NotVerified, WorkerError) and not issubclass(NotVerified, LoadRefused)
    state.sticky_unload = False
    assert "a1" not in resident(await client.unload("http://w", TOKEN, "a1"))
    await client.close()


async def test_a_worker_answering_503_is_transient(tmp_path: Path) -> None:
    write_adapter(tmp_path, "a1")
    state = FakeWorkerState(token=TOKEN, adapter_root=tmp_path, down=True)
    client = in_process(state)
    with pytest.raises(WorkerUnavailable, match="503"):
        await client.load("http://w", TOKEN, "a1", str(tmp_path / "a1"))
    state.down = False
    assert "a1" in resident(await client.load("http://w", TOKEN, "a1", str(tmp_path / "a1")))
    await client.close()


def scripted(load_status: int, load_body: dict, resident_after: list[str]) -> WorkerClient:
    """A worker whose load answers `load_status`/`load_body` and whose inventory then lists `resident_after`."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(load_status, json=load_body)
        adapters = [{"name": n, "tier": "cpu", "rank": 8, "alpha": 16.0, "digest": "sha256:00", "path": "/a"}
                    for n in resident_after]
        return httpx.Response(200, json={"model": "m", "max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": 16,
                                         "max_loras_per_request": 2, "adapters": adapters})

    return WorkerClient(httpx.AsyncClient(transport=httpx.MockTransport(handle)))


async def test_a_load_that_answers_200_but_is_not_resident_is_not_verified() -> None:
    client = scripted(200, {"status": "ok"}, [])
    with pytest.raises(NotVerified, match="not resident"):
        await client.load("http://w", TOKEN, "a1", "/a/a1")
    await client.close()


async def test_vllms_already_loaded_400_defers_to_the_inventory() -> None:
    body = {"error": {"message": "The lora adapter 'a1' has already been loaded.", "code": 400}}
    client = scripted(400, body, ["a1"])
    assert "a1" in resident(await client.load("http://w", TOKEN, "a1", "/a/a1"))
    await client.close()
    client = scripted(400, body, [])  # "already loaded", yet not there: not trusted either
    with pytest.raises(NotVerified):
        await client.load("http://w", TOKEN, "a1", "/a/a1")
    await client.close()


@pytest.mark.parametrize(("reason", "error"), [("in_use", WorkerBusy), ("draining", WorkerBusy),
                                              ("conflict", LoadRefused)])
async def test_a_conflict_with_requests_in_flight_is_transient(reason: str, error: type) -> None:
    """The old version still serves requests: the swap waits for them; other 409s are permanent."""
    body = {"error": {"message": "adapter 'a1' has 2 requests in flight", "code": 409, "reason": reason}}
    client = scripted(409, body, ["a1"])
    with pytest.raises(error):
        await client.load("http://w", TOKEN, "a1", "/a/a1", inplace=True)
    await client.close()


@pytest.mark.parametrize("answer", [httpx.Response(200, text="<html>hello</html>"),
                                    httpx.Response(200, json={"adapters": "none"})], ids=["html", "wrong-shape"])
async def test_an_inventory_that_is_not_one_is_transient(answer: httpx.Response) -> None:
    """Something else on the admin port (a starting pod, an older worker) must not crash the pool's
    reconcile loop: the worker counts as unavailable this round."""
    client = WorkerClient(httpx.AsyncClient(transport=httpx.MockTransport(lambda _request: answer)))
    with pytest.raises(WorkerUnavailable, match="not an adapter inventory"):
        await client.inventory("http://w", TOKEN)
    await client.close()

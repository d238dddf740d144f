"""The router and workers whose admin API is on a port of its own, with per-pool admin tokens,
and adapters that leave the catalog (a deleted LoraAdapter)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from lorafleet.placement_store import MemoryPlacementStore
from tests.router.conftest import CATALOG, RouterThread, router_settings
from tests.router.fake_worker import FakeWorkerConfig, FakeWorkerProcess, free_port

pytestmark = pytest.mark.timeout(120)


def write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a new file, as a rotated Secret volume gets


def ask(router: RouterThread, model: str) -> tuple[str, str]:
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=30)
    raw = c.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=4)
    return raw.headers["x-lorafleet-replica"], raw.parse().choices[0].text


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_admin_port_and_per_pool_tokens_with_rotation(tmp_path):
    """Two pools, two tokens, admin APIs on their own ports: polls and cold loads reach them."""
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    write(tokens / "pool-a", "token-a")
    write(tokens / "pool-b", "token-b")
    w0 = FakeWorkerProcess(
        FakeWorkerConfig(
            name="w0", admin_token="token-a", admin_port=free_port(), lora_modules={"a": CATALOG["a"]}
        )
    )
    w1 = FakeWorkerProcess(
        FakeWorkerConfig(
            name="w1", admin_token="token-b", admin_port=free_port(), lora_modules={"b": CATALOG["b"]}
        )
    )
    try:
        w0.start(), w1.start()
        # The admin API is not on the public port at all (as with `lorafleet worker --admin-port`).
        assert (
            httpx.get(w0.url + "/v1/adapters", headers={"Authorization": "Bearer token-a"}).status_code == 404
        )
        settings = replace(
            router_settings([]),
            workers=(f"{w0.worker_arg},pool=pool-a", f"{w1.worker_arg},pool=pool-b"),
            admin_token=None,
            admin_token_dir=tokens,
        )
        with RouterThread(settings) as router:
            assert ask(router, "a") == (f"127.0.0.1:{w0.port}", "[w0] a")  # known by the poll: hot
            assert ask(router, "b") == (f"127.0.0.1:{w1.port}", "[w1] b")
            assert router.metric("lorafleet_router_routes_total", reason="cold") == 0
            replica, text = ask(router, "c")  # cold: loaded through the admin port with the pool's token
            assert text.endswith(" c") and router.metric("lorafleet_router_cold_loads_total") == 1
            assert sum(w.stats()["loads"].get("c", 0) for w in (w0, w1)) == 1

            # pool-a's token rotates: the worker takes only the new one, the router re-reads the file.
            w0.kill()
            w0 = FakeWorkerProcess(
                FakeWorkerConfig(name="w0", admin_token="token-a2", admin_port=w0.cfg.admin_port),
                port=w0.port,
            ).start()
            write(tokens / "pool-a", "token-a2")
            replica, text = ask(router, "d")  # lands where rendezvous hashing puts it; either pool works
            assert text.endswith(" d")
            wait_until(
                lambda: router.metric("lorafleet_router_load_failures_total") == 0 and _polled(router, w0)
            )
    finally:
        w0.kill()
        w1.kill()


def _polled(router: RouterThread, worker: FakeWorkerProcess) -> bool:
    replica = router.app.state.gateway.fleet.replicas.get(f"127.0.0.1:{worker.port}")
    return replica is not None and replica.inventory is not None and replica.reachable


def test_adapters_that_leave_the_catalog_are_dropped(two_workers):
    """A deleted LoraAdapter (store catalog entry removed) is neither listed nor routed, even while
    a replica still holds it; re-created, it is back."""
    store = MemoryPlacementStore()
    w0, _ = two_workers
    settings = router_settings(two_workers, lora_modules={"c": CATALOG["c"]})
    with RouterThread(settings, store=store) as router:

        def listed() -> set[str]:
            return {m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]}

        store._catalog.update({"a": CATALOG["a"], "d": CATALOG["d"]})  # what the operator publishes
        wait_until(lambda: {"a", "c", "d"} <= listed())
        assert ask(router, "a")[1] == "[w0] a"
        asyncio.run(store.remove_catalog("a"))
        asyncio.run(store.remove_catalog("d"))
        wait_until(lambda: "a" not in listed() and "d" not in listed())
        for model in ("a", "d"):  # a is still resident on w0: refused all the same; d never loads
            resp = httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": "x"})
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        assert "c" in listed()  # static (--lora-modules) entries stay
        assert "b" in listed()  # a worker's start-up adapter, never in the store's catalog, stays routable
        asyncio.run(store.set_catalog({"a": CATALOG["a"]}))
        wait_until(lambda: "a" in listed())
        assert ask(router, "a")[1] == "[w0] a"
    assert sum(w.stats()["loads"].get("d", 0) for w in two_workers) == 0

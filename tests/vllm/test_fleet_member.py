"""A stock vLLM server as a fleet member: one vLLM and one lorafleet worker behind one router.

Static discovery: each replica is named by its kind (`--worker vllm=URL`, `lorafleet=URL`) or probed
(a bare URL). Kubernetes discovery: the two are pods in the kmock emulator (tests/operator), the vLLM
pod's kind an annotation and its LoRA limits its container's flags, ours labelled, and the router
lists them through the API server. Each pool has its own token (vLLM's `--api-key`, our admin token)
in `--admin-token-dir`. Our worker listens on 127.0.0.2 at vLLM's port: a pool's pods share one port.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.router.settings import RouterSettings
from lorafleet.worker.config import EngineConfig
from lorafleet.worker.server.settings import WorkerSettings
from tests.router.conftest import RouterThread
from tests.vllm.assets import MAX_LORA_RANK
from tests.vllm.conftest import VLLM_ONLY
from tests.vllm.vllm_server import API_KEY, skip_reason, vllm_python
from tests.worker.worker_harness import RunningWorker

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm,
              pytest.mark.skipif(vllm_python() is None, reason=skip_reason())]

OURS_ONLY = "oonly"  # on our worker at start-up (the `chat` weights), nowhere else
COLD = "cold"  # in the router's catalog (the `code` weights), held by nobody at first
OUR_TOKEN = "our-admin-token"
OUR_HOST = "127.0.0.2"  # vLLM listens on 127.0.0.1, at the same port


@pytest.fixture(scope="module")
def our_worker(vllm_server, vllm_assets, adapter_dirs, served_name, tmp_path_factory) -> Iterator[RunningWorker]:
    token = tmp_path_factory.mktemp("our-token") / "token"
    token.write_text(OUR_TOKEN)
    settings = WorkerSettings(
        model=str(vllm_assets / "model"), served_model_name=served_name,
        lora_modules=((OURS_ONLY, str(adapter_dirs["chat"])),), admin_token_file=str(token),
        engine=EngineConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=MAX_LORA_RANK, num_kv_blocks=256,
                            dtype="float32"),
        freeze_gc=False,
    )
    w = RunningWorker(settings, host=OUR_HOST, port=httpx.URL(vllm_server.url).port).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def fresh_vllm(vllm_server):
    """vLLM holding its start-up adapter only (other tests of the session may have loaded more)."""
    for name, parent in vllm_server.models().items():
        if parent and name != VLLM_ONLY:
            vllm_server.unload(name)
    assert [n for n, p in vllm_server.models().items() if p] == [VLLM_ONLY]
    return vllm_server


def settings_for(vllm_url: str, our_url: str, tokens, adapter_dirs, probe: bool) -> RouterSettings:
    vllm = f"{vllm_url},pool=vpool,max_cpu_loras=8,max_lora_rank={MAX_LORA_RANK}"
    ours = f"{our_url},pool=opool"
    workers = (vllm, ours) if probe else (f"vllm={vllm}", f"lorafleet={ours}")
    return RouterSettings(workers=workers, admin_token_dir=tokens, poll_interval_s=0.2,
                          lora_modules={COLD: str(adapter_dirs["code"])}, load_timeout_s=120)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "vpool").write_text(API_KEY)
    (folder / "opool").write_text(OUR_TOKEN)
    return folder


def complete(router: RouterThread, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": "The router sends", "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=180)


def wait_polled(router: RouterThread, count: int) -> None:
    fleet = router.app.state.gateway.fleet
    deadline = time.monotonic() + 30
    while sum(r.inventory is not None for r in fleet.replicas.values()) < count:
        assert time.monotonic() < deadline, "the router did not poll both replicas"
        time.sleep(0.1)


@pytest.mark.parametrize("probe", [False, True], ids=["declared", "probed"])
def test_mixed_fleet_routes_by_residency_and_loads_cold(fresh_vllm, our_worker, tokens, adapter_dirs,
                                                        served_name, probe):
    vllm_name, our_name = fresh_vllm.url.removeprefix("http://"), our_worker.url.removeprefix("http://")
    with RouterThread(settings_for(fresh_vllm.url, our_worker.url, tokens, adapter_dirs, probe)) as router:
        wait_polled(router, 2)
        kinds = {n: r.kind for n, r in router.app.state.gateway.fleet.replicas.items()}
        assert kinds == {vllm_name: "vllm", our_name: "lorafleet"}

        for _ in range(3):  # residency, not luck
            r = complete(router, VLLM_ONLY)
            assert r.status_code == 200, r.text
            assert r.headers["x-lorafleet-replica"] == vllm_name and r.json()["model"] == VLLM_ONLY
            r = complete(router, OURS_ONLY)
            assert r.status_code == 200, r.text
            assert r.headers["x-lorafleet-replica"] == our_name

        r = complete(router, COLD)
        assert r.status_code == 200, r.text
        chosen = r.headers["x-lorafleet-replica"]
        if chosen == vllm_name:
            assert fresh_vllm.models().get(COLD) == served_name  # vLLM's own listing has it
        else:
            inventory = httpx.get(f"{our_worker.url}/v1/adapters", timeout=10,
                                  headers={"Authorization": f"Bearer {OUR_TOKEN}"}).json()
            assert COLD in {a["name"] for a in inventory["adapters"]}
        assert complete(router, COLD).headers["x-lorafleet-replica"] == chosen  # warm now

        listed = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]
        ids = [m["id"] for m in listed]
        assert sorted(ids) == sorted([served_name, VLLM_ONLY, OURS_ONLY, COLD])  # each once

        # one adapter through the RFC field reaches vLLM as `model`
        r = complete(router, served_name, lora_adapters=[{"name": VLLM_ONLY}])
        assert r.status_code == 200 and r.headers["x-lorafleet-replica"] == vllm_name, r.text

        body = {"model": VLLM_ONLY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=180) as resp:
            assert resp.status_code == 200
            assert resp.headers["x-lorafleet-replica"] == vllm_name
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert len(events) >= 4 and events[-1] == "data: [DONE]"

        if chosen == vllm_name:  # leave vLLM as the next run found it
            fresh_vllm.unload(COLD)


async def test_the_loaders_load_and_unload_on_vllm_are_checked_against_its_listing(fresh_vllm, tokens,
                                                                                  adapter_dirs):
    """The router's loader on a vLLM replica: the load lands in vLLM's /v1/models; an unload is
    counted once vLLM's listing drops the adapter, not on its 200 alone."""
    from lorafleet.placement_store import MemoryPlacementStore
    from lorafleet.router.admin_tokens import AdminTokens
    from lorafleet.router.discovery import StaticDiscovery, parse_worker
    from lorafleet.router.fleet import Fleet
    from lorafleet.router.loader import AdapterLoader
    from lorafleet.router.metrics import RouterMetrics
    from lorafleet.router.placement import PlacementSync

    endpoint = parse_worker(f"vllm={fresh_vllm.url},pool=vpool")
    fleet = Fleet()
    fleet.set_endpoints([endpoint])
    replica = fleet.replicas[endpoint.name]
    catalog = {"scratch": str(adapter_dirs["sql"])}
    metrics = RouterMetrics.create()
    admin = AdminTokens(directory=tokens)
    async with httpx.AsyncClient() as http:
        sync = PlacementSync(fleet, MemoryPlacementStore(), StaticDiscovery([endpoint]), http, metrics, 30.0,
                             catalog, admin)
        loader = AdapterLoader(http, sync, metrics, catalog, admin, 120.0)
        await sync.sync_once()
        assert replica.kind == "vllm" and "scratch" not in replica.residency()
        await loader.ensure(replica, ("scratch",))
        assert fresh_vllm.models().get("scratch") is not None
        await sync.sync_once()
        assert replica.residency().get("scratch") in ("gpu", "cpu")
        await loader.unload(replica, "scratch")
        assert "scratch" not in fresh_vllm.models()
        assert metrics.unloads.labels(replica.name)._value.get() == 1
        await sync.sync_once()
        assert "scratch" not in replica.residency()


class KmockThread:
    """The kmock API server (tests/operator's patched emulator) on its own event loop and thread, so
    the router's discovery, in the router's thread, can list pods while the test waits."""

    def __enter__(self) -> KmockThread:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.api, self.url = self.run(self._start())
        return self

    async def _start(self):
        import contextlib

        import kmock

        from tests.operator.kmock_harness import PatchedEmulator

        self._stack = contextlib.AsyncExitStack()
        api = await self._stack.enter_async_context(PatchedEmulator())
        await self._stack.enter_async_context(kmock.Server(api))
        return api, str(api.url).rstrip("/")

    def run(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def put_pod(self, name: str, ip: str, labels: dict, annotations: dict, argv: list[str], port: int) -> None:
        self.run(self.api.put_object("v1/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "server", "command": argv[:3], "args": argv[3:],
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }))

    def __exit__(self, *exc: object) -> None:
        self.run(self._stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def api_server_at(url: str):
    """An httpx transport that sends what the router addresses to https://kubernetes.default.svc to
    the emulator (the router's discovery names the in-cluster API server)."""

    class ToKmock(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.target, self.inner = httpx.URL(url), httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            assert request.url.host == "kubernetes.default.svc", request.url
            request.url = request.url.copy_with(scheme="http", host=self.target.host, port=self.target.port)
            return await self.inner.handle_async_request(request)

    return ToKmock()


K8S_COLD = "kcold"  # in the catalog (the `sql` weights), held by nobody at first


def test_mixed_fleet_through_kubernetes_discovery(fresh_vllm, our_worker, tokens, adapter_dirs, served_name,
                                                  monkeypatch, tmp_path):
    pytest.importorskip("kmock")
    import certifi

    from lorafleet.router import api as router_api
    from lorafleet.router import discovery

    port = httpx.URL(fresh_vllm.url).port
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("router-sa-token\n")
    (sa / "ca.crt").write_bytes(Path(certifi.where()).read_bytes())  # the client loads one; unused over http
    monkeypatch.setattr(discovery, "SA_DIR", sa)
    monkeypatch.setattr(router_api, "SA_DIR", sa)
    with KmockThread() as kube:
        real = discovery.KubernetesDiscovery
        monkeypatch.setattr(router_api, "KubernetesDiscovery", lambda _http, *args: real(
            httpx.AsyncClient(transport=api_server_at(kube.url), timeout=5.0), *args))
        component = {"app.kubernetes.io/component": "worker"}
        kube.put_pod("vllm-0", "127.0.0.1", {**component, "lorafleet.dev/pool": "vpool"},
                     {"lorafleet.dev/worker-kind": "vllm"}, fresh_vllm.argv, port)
        kube.put_pod("ours-0", OUR_HOST, {**component, "lorafleet.dev/pool": "opool",
                                          "lorafleet.dev/worker-kind": "lorafleet"}, {},
                     ["python", "-m", "lorafleet", "worker"], port)
        kube.put_pod("other-0", "127.0.0.3", {"app.kubernetes.io/component": "db"}, {}, ["db"], port)
        settings = RouterSettings(discovery="kubernetes", k8s_namespace="default", k8s_port=port,
                                  k8s_selector="app.kubernetes.io/component=worker", admin_token_dir=tokens,
                                  poll_interval_s=0.2, lora_modules={K8S_COLD: str(adapter_dirs["sql"])},
                                  load_timeout_s=120)
        with RouterThread(settings) as router:
            wait_polled(router, 2)
            replicas = router.app.state.gateway.fleet.replicas
            assert {n: r.kind for n, r in replicas.items()} == {"vllm-0": "vllm", "ours-0": "lorafleet"}
            # the vLLM pod's limits come from its container's flags
            assert replicas["vllm-0"].limits.max_cpu_loras == fresh_vllm.max_cpu_loras

            for model, where in ((VLLM_ONLY, "vllm-0"), (OURS_ONLY, "ours-0")) * 2:
                r = complete(router, model)
                assert r.status_code == 200, r.text
                assert r.headers["x-lorafleet-replica"] == where and r.json()["model"] == model

            r = complete(router, K8S_COLD)
            assert r.status_code == 200, r.text
            chosen = r.headers["x-lorafleet-replica"]
            if chosen == "vllm-0":
                assert fresh_vllm.models().get(K8S_COLD) == served_name
            else:
                inventory = httpx.get(f"{our_worker.url}/v1/adapters", timeout=10,
                                      headers={"Authorization": f"Bearer {OUR_TOKEN}"}).json()
                assert K8S_COLD in {a["name"] for a in inventory["adapters"]}

            ids = [m["id"] for m in httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"]]
            assert sorted(ids) == sorted([served_name, VLLM_ONLY, OURS_ONLY, K8S_COLD])  # each once

            body = {"model": VLLM_ONLY, "prompt": "The router sends", "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=180) as resp:
                assert resp.status_code == 200 and resp.headers["x-lorafleet-replica"] == "vllm-0"
                assert resp.headers["content-type"].startswith("text/event-stream")
                events = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
            assert len(events) >= 4 and events[-1] == "data: [DONE]"
        if chosen == "vllm-0":  # leave vLLM as the next test found it
            fresh_vllm.unload(K8S_COLD)

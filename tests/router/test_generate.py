"""The proxied routes: stale routing (a worker's "not loaded" 404), client disconnects reaching the
worker (during its generation and during a cold load), and every error in OpenAI's envelope."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lorafleet.protocol import MAX_TOKENS_ZERO
from lorafleet.router.proxy import not_loaded
from lorafleet.router.settings import RouterSettings
from tests.router.conftest import ADMIN_TOKEN, CATALOG, RouterThread, router_settings, start_workers
from tests.router.fake_worker import FakeWorkerProcess

pytestmark = pytest.mark.timeout(120)

def unload(worker: FakeWorkerProcess, name: str) -> None:
    """Behind the router's back, as the operator's reconciler (or the worker's own LRU) does."""
    resp = httpx.post(
        worker.admin_url + "/v1/unload_lora_adapter",
        json={"lora_name": name},
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert resp.status_code == 200, resp.text


def test_not_loaded_404_goes_to_another_replica_that_holds_it():
    workers = start_workers([{"name": f"w{i}", "lora_modules": {"a": "/adapters/a"}} for i in range(2)])
    try:
        # No poll after start-up: the router keeps routing on its stale view.
        with RouterThread(router_settings(workers, poll_interval_s=60.0)) as router:
            first = httpx.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x"})
            assert first.status_code == 200, first.text
            chosen = first.headers["x-lorafleet-replica"]
            holder = next(w for w in workers if chosen == f"127.0.0.1:{w.port}")
            other = next(w for w in workers if w is not holder)
            unload(holder, "a")
            resp = httpx.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x"})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == f"[{other.cfg.name}] a"
            assert router.metric("lorafleet_router_retries_total", reason="not_loaded") == 1
            assert router.metric("lorafleet_router_ejections_total") == 0
            assert all(w.stats()["loads"] == {} for w in workers)  # served where it was, no load
    finally:
        for w in workers:
            w.kill()


def test_not_loaded_404_takes_the_cold_load_path(two_workers):
    w0, _ = two_workers
    with RouterThread(router_settings(two_workers, poll_interval_s=60.0)) as router:
        unload(w0, "a")  # the only copy
        with httpx.stream(
            "POST", router.url + "/v1/completions", json={"model": "a", "prompt": "x", "stream": True}
        ) as resp:
            assert resp.status_code == 200, resp.read()
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '" a"' in "".join(events)
        assert router.metric("lorafleet_router_retries_total", reason="not_loaded") == 1
        assert sum(w.stats()["loads"].get("a", 0) for w in two_workers) == 1


def test_a_composed_requests_stale_404_marks_only_the_adapter_it_names():
    workers = start_workers([{"name": "w0", "lora_modules": {"a": "/adapters/a", "b": "/adapters/b"}}])
    body = {"model": "demo-base", "prompt": "x", "lora_adapters": [{"name": "a"}, {"name": "b"}]}
    try:
        with RouterThread(router_settings(workers, poll_interval_s=60.0)) as router:
            assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
            unload(workers[0], "a")
            resp = httpx.post(router.url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert router.metric("lorafleet_router_retries_total", reason="not_loaded") == 1
            assert workers[0].stats()["loads"] == {"a": 1}  # b, still there, was not loaded again
    finally:
        for w in workers:
            w.kill()


def test_too_many_composed_adapters_are_refused_before_any_load(two_workers):
    names = [{"name": n} for n in ("a", "b", "c")]  # the fake workers allow 2
    with RouterThread(router_settings(two_workers)) as router:
        resp = httpx.post(router.url + "/v1/completions",
                          json={"model": "demo-base", "prompt": "x", "lora_adapters": names})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "lora_adapters", error
        assert error["message"] == "3 adapters requested; the workers serving 'demo-base' allow max_loras_per_request=2"
        assert all(w.stats()["loads"] == {} for w in two_workers)  # nothing was loaded for it
        ok = httpx.post(router.url + "/v1/completions",
                        json={"model": "demo-base", "prompt": "x", "lora_adapters": names[:2]})
        assert ok.status_code == 200, ok.text


def test_a_composed_request_goes_only_to_workers_that_take_that_many():
    modules = {n: CATALOG[n] for n in ("a", "b", "c")}
    workers = start_workers([{"name": "narrow", "lora_modules": modules, "max_loras_per_request": 2},
                             {"name": "wide", "lora_modules": modules, "max_loras_per_request": 3}])
    body = {"model": "demo-base", "prompt": "x", "lora_adapters": [{"name": n} for n in modules]}
    try:
        with RouterThread(router_settings(workers)) as router:
            for _ in range(6):
                resp = httpx.post(router.url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"].startswith("[wide]"), resp.text
            assert router.metric("lorafleet_router_retries_total") == 0
    finally:
        for w in workers:
            w.kill()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"error": {"message": "The model `a` does not exist."}}', ("a",)),  # vLLM
        (b'{"error": {"message": "adapter \'b\' is not loaded on this worker"}}', ("b",)),  # ours
        (b'{"error": {"message": "adapter \'ab\' is not loaded on this worker"}}', ()),  # another name
        (b'{"detail": "Not Found"}', ()),
        (b"not json", ()),
        (b'{"error": {"message": 5}}', ()),
    ],
)
def test_not_loaded_reads_which_adapters_a_404_names(body, expected):
    assert not_loaded(body, ("a", "b")) == expected


def wait_for(predicate, timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("fast_http", [True, False], ids=["fast_http", "uvicorn"])
@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_worker_request(two_workers, stream, fast_http):
    w0, _ = two_workers
    # 400 tokens at 5 ms: about 2 s of generation (more with the event loop's timer granularity).
    body = {"model": "a", "prompt": "x", "max_tokens": 400, "stream": stream}
    with RouterThread(router_settings(two_workers, fast_http=fast_http)) as router, httpx.Client(timeout=0.5) as client:
        if stream:
            with client.stream("POST", router.url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                next(resp.iter_raw())  # the first event: the worker is generating
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(router.url + "/v1/completions", json=body)
        client.close()  # the client leaves mid-generation
        elapsed = wait_for(lambda: w0.stats()["aborted"].get("a") == 1, timeout_s=1.5)
        assert elapsed < 1.0, f"the worker's request outlived the client by {elapsed:.2f}s"
        wait_for(lambda: router.metric("lorafleet_router_requests_total", status="499") == 1, timeout_s=1.0)
        assert w0.stats()["aborted"] == {"a": 1}


@pytest.mark.parametrize(("max_cpu_loras", "kept"), [(8, ["a", "c"]), (1, [])])
def test_client_leaving_during_a_cold_load_is_let_go(max_cpu_loras, kept):
    """A client that leaves while its adapter loads is counted gone (499) at once, not when the load
    lands; the load runs on, and the request never reaches the worker. With room in the cache the
    copy is admitted and stays; in a one-slot cache held by a more popular adapter it is not (that
    one makes way, the copy takes it as scratch), and with no request left the copy is unloaded
    once it lands."""
    workers = start_workers([{"name": "w0", "lora_modules": {"a": CATALOG["a"]}, "max_cpu_loras": max_cpu_loras,
                              "load_delay_s": 1.5}])
    try:
        with RouterThread(router_settings(workers)) as router, httpx.Client(timeout=0.3) as client:
            for _ in range(3):  # a is the popular one
                assert client.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x"}).is_success
            with pytest.raises(httpx.ReadTimeout):
                client.post(router.url + "/v1/completions", json={"model": "c", "prompt": "x"})
            client.close()  # the client leaves 0.3 s into a 1.5 s load
            left = time.monotonic()
            wait_for(lambda: router.metric("lorafleet_router_requests_total", status="499") == 1, timeout_s=3.0)
            assert time.monotonic() - left < 0.8, "the router held the request until the load landed"
            wait_for(lambda: workers[0].stats()["loads"] == {"c": 1}, timeout_s=3.0)
            wait_for(lambda: workers[0].stats()["resident"] == kept, timeout_s=2.0)
            time.sleep(0.3)
            assert workers[0].stats()["resident"] == kept and workers[0].stats()["served"] == {"a": 3}
    finally:
        for w in workers:
            w.kill()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_worker_dying_mid_stream_ends_the_clients_stream_cleanly(path):
    """The stream began, then its worker died: the client's stream ends as the worker ends one on an
    error (the error object, then [DONE]) and the response is complete (no cut-off body)."""
    workers = start_workers([{"name": "w0", "token_delay_s": 0.2}])
    body = {"model": "demo-base", "stream": True, "max_tokens": 30} | (
        {"prompt": "p"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "p"}]})
    try:
        with RouterThread(router_settings(workers)) as router:
            with httpx.stream("POST", router.url + path, json=body, timeout=10) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 1:
                        workers[0].kill()
            data = [ln.removeprefix("data: ") for ln in lines if ln]
            assert data[-1] == "[DONE]" and "upstream failed mid-stream" in json.loads(data[-2])["error"]["message"]
            assert router.metric("lorafleet_router_requests_total", status="stream_error") == 1
            assert router.app.state.gateway.fleet.replicas[f"127.0.0.1:{workers[0].port}"].inflight == 0
    finally:
        for w in workers:
            w.kill()


def test_failed_loads_do_not_eject_a_healthy_replica():
    """Three concurrent requests give up on a slow cold load (the wait's timeout), and three ask for
    an adapter only a dead worker held (started with it; not in the catalog): each is a 503, none
    counts against the live replica, which serves the base model after; the slow load lands."""
    workers = start_workers([{"name": "w0", "load_delay_s": 1.0},
                             {"name": "w1", "lora_modules": {"x": "/adapters/x"}}])
    try:
        with RouterThread(router_settings(workers, load_timeout_s=0.3, eject_cooldown_s=30.0)) as router:
            def post(model: str) -> httpx.Response:
                return httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": "p"}, timeout=10)

            assert post("x").status_code == 200
            workers[1].kill()
            wait_for(lambda: post("x").status_code == 503, timeout_s=5.0)  # the poll saw it gone
            with ThreadPoolExecutor(3) as pool:
                slow = list(pool.map(post, ["c"] * 3))
            gone = [post("x") for _ in range(3)]
            assert [r.status_code for r in slow + gone] == [503] * 6
            assert all(re.search(r"took longer than 0.3s|ReadTimeout", r.json()["error"]["message"]) for r in slow)
            assert "'x' is not in the catalog: only a replica holding it can serve it" in gone[0].json()["error"]["message"]
            assert router.metric("lorafleet_router_ejections_total") == 0
            assert post("demo-base").status_code == 200
            wait_for(lambda: workers[0].stats()["resident"] == ["c"], timeout_s=3.0)
    finally:
        for w in workers:
            w.kill()


def test_every_error_is_in_the_openai_envelope(two_workers):
    with RouterThread(router_settings(two_workers)) as router:
        cases = [
            ("GET", "/v1/completions", None, 405, "Invalid method for URL (GET /v1/completions)"),
            ("GET", "/v1/chat/completions", None, 405, "Invalid method for URL (GET /v1/chat/completions)"),
            ("POST", "/v1/models", None, 405, "Invalid method for URL (POST /v1/models)"),
            ("GET", "/v1/nope", None, 404, "Invalid URL (GET /v1/nope)"),
            ("POST", "/v1/completions", {"prompt": "x"}, 400, "`model` is required."),
            (
                "POST",
                "/v1/completions",
                {"model": 5, "prompt": "x"},
                400,
                "model: Input should be a valid string",
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "a", "prompt": "x", "max_tokens": 0},
                400,
                MAX_TOKENS_ZERO,
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "a", "prompt": "x", "max_tokens": True},
                400,
                "max_tokens: Input should be a valid integer",
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "a", "prompt": "x", "stream": "false"},
                400,
                "stream: Input should be a valid boolean",
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "demo-base", "prompt": "x", "lora_adapters": 5},
                400,
                "invalid `lora_adapters`: Input should be a valid list",
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "demo-base", "prompt": "x", "lora_adapters": [{"name": "a", "scale": "0.5"}]},
                400,
                "lora_adapters.0.scale: Input should be a valid number",  # the worker's wording
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "nope", "prompt": "x"},
                404,
                "The model `nope` does not exist or you do not have access to it.",
            ),
            (
                "POST",
                "/v1/completions",
                {"model": "demo-base", "prompt": "x", "lora_adapters": [{"name": "a"}, {"name": "ghost"}]},
                404,
                "The model `ghost` does not exist or you do not have access to it.",
            ),
        ]
        for method, path, body, status, message in cases:
            resp = httpx.request(method, router.url + path, json=body)
            assert resp.status_code == status, (method, path, body, resp.text)
            error = resp.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}, resp.text
            assert error["message"] == message, (method, path, body, resp.text)
            if status == 405:
                assert resp.headers["allow"] in ("POST", "GET"), resp.headers
        deep = b"[" * 100_000 + b"]" * 100_000  # parses past Python's recursion limit
        resp = httpx.post(router.url + "/v1/completions", content=deep, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == "Request body must be a JSON object."
        ok = httpx.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x", "stream": False})
        assert ok.status_code == 200, ok.text


def test_the_routers_n_cap_is_at_most_the_workers() -> None:
    from lorafleet.protocol import MAX_N
    from lorafleet.router.cli import build_parser, settings_from_args

    assert RouterSettings().max_n == MAX_N
    assert settings_from_args(build_parser().parse_args(["--max-n", "4"])).max_n == 4
    with pytest.raises(ValueError, match=f"--max-n 32: must be in 1..{MAX_N}"):
        settings_from_args(build_parser().parse_args(["--max-n", "32"]))

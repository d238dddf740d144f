"""The admin API on a real uvicorn server: auth matrix, path confinement, refused adapters (the
server keeps serving), load/unload lifecycle, idempotence, conflicts, single flight, admin port."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time

import httpx
import pytest

from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.worker_harness import TOKEN, RunningWorker, auth, wait_for, worker_settings

PROMPT = "Every institute uses the same printed textbook"


@pytest.fixture(scope="module")
def layout(tmp_path_factory, demo_adapters):
    """An adapter root with good copies and malformed folders built from a demo adapter."""
    base = tmp_path_factory.mktemp("admin")
    root = base / "root"
    root.mkdir()
    for name in ("poem", "code", "legal"):
        shutil.copytree(demo_adapters[name], root / name)
    sql = demo_adapters["sql"]

    def variant(name: str, edit=None, drop_weights: bool = False) -> None:
        shutil.copytree(sql, root / name)
        if edit is not None:
            cfg_path = root / name / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            edit(cfg)
            cfg_path.write_text(json.dumps(cfg))
        if drop_weights:  # the same tensors, but only as a pickle
            (root / name / "adapter_model.safetensors").rename(root / name / "adapter_model.bin")

    variant("dora", lambda c: c.update(use_dora=True))
    variant("pickled", drop_weights=True)
    variant("rank_high", lambda c: c.update(r=128))
    variant("sql_v2", lambda c: c.update(lora_alpha=c["lora_alpha"] * 2))  # same name later: different content
    shutil.copytree(sql, base / "outside")
    os.symlink(base / "outside", root / "escape")
    token = base / "token"
    token.write_text(TOKEN + "\n")
    return {"root": root, "base": base, "token": token}


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters, layout):
    adapters = {n: demo_adapters[n] for n in ("sql", "chat")}
    w = RunningWorker(worker_settings(demo_model, adapters, token_file=layout["token"],
                                      adapter_root=layout["root"])).start()
    yield w
    w.stop()


def load(worker, name: str, path: str, headers=None, **extra) -> httpx.Response:
    return httpx.post(f"{worker.admin_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      headers=auth() if headers is None else headers)


def unload(worker, name: str, headers=None) -> httpx.Response:
    return httpx.post(f"{worker.admin_url}/v1/unload_lora_adapter", json={"lora_name": name},
                      headers=auth() if headers is None else headers)


def inventory(worker) -> dict:
    """The worker's inventory, each adapter's `idle_s` checked and dropped (it grows between calls)."""
    r = httpx.get(f"{worker.admin_url}/v1/adapters", headers=auth())
    assert r.status_code == 200, r.text
    inv = r.json()
    for a in inv["adapters"]:
        idle = a.pop("idle_s")
        assert (idle is None) == (a["last_used"] is None) and (idle is None or idle >= 0), a
    return inv


def models(worker) -> set[str]:
    return {m["id"] for m in httpx.get(f"{worker.url}/v1/models").json()["data"]}


def complete(worker, model: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/completions",
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


def loads_metric(worker, result: str) -> float:
    prefix = f'lorafleet:lora_admin_loads_total{{result="{result}"}} '
    lines = [ln for ln in httpx.get(f"{worker.url}/metrics").text.splitlines() if ln.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


# -- auth -----------------------------------------------------------------------------------------

ROUTES = [
    ("GET", "/v1/adapters", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "poem", "lora_path": "poem"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "no-such-adapter"}),
]
CREDENTIALS = {
    "none": {},
    "wrong": {"Authorization": "Bearer not-the-token"},
    "prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "basic": {"Authorization": f"Basic {TOKEN}"},
    "bare": {"Authorization": TOKEN},
    "right": auth(),
}


@pytest.mark.parametrize("cred", list(CREDENTIALS))
@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_auth_matrix(worker, method, path, body, cred):
    r = httpx.request(method, f"{worker.admin_url}{path}", json=body, headers=CREDENTIALS[cred])
    if cred == "right":
        assert r.status_code != 401, r.text
    else:
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == 401
        assert TOKEN not in r.text
        assert r.headers.get("www-authenticate") == "Bearer"


def test_admin_disabled_without_token_file(demo_model, demo_adapters):
    w = RunningWorker(worker_settings(demo_model, {"sql": demo_adapters["sql"]})).start()
    try:
        for method, path, body in ROUTES:
            r = httpx.request(method, f"{w.url}{path}", json=body, headers=auth())
            assert r.status_code == 401 and "--admin-token-file" in r.json()["error"]["message"]
        assert complete(w, "sql").status_code == 200  # the public API is unaffected
    finally:
        w.stop()


def test_token_is_not_logged(worker, caplog):
    caplog.set_level("DEBUG")
    load(worker, "poem", "poem")
    load(worker, "poem", "poem", headers={"Authorization": "Bearer wrong-guess"})
    assert TOKEN not in caplog.text and "wrong-guess" not in caplog.text


# -- refused adapters: a reason each, and the server keeps serving -------------------------------


@pytest.mark.parametrize("case,path,status,reason", [
    ("traversal", "../outside", 400, "path_outside_root"),
    ("traversal-deep", "poem/../../outside", 400, "path_outside_root"),
    ("absolute-elsewhere", "{outside}", 400, "path_outside_root"),
    ("symlink-escape", "escape", 400, "path_outside_root"),
    ("root-itself", ".", 400, "path_outside_root"),
    ("missing", "does-not-exist", 400, "not_found"),
    ("dora-without-magnitudes", "dora", 400, "bad_weights"),  # use_dora: true, no lora_magnitude_vector
    ("pickle-only", "pickled", 400, "pickle"),
    ("rank-too-high", "rank_high", 400, "rank_too_high"),
])
def test_refused_adapters(worker, layout, case, path, status, reason):
    before = inventory(worker)["adapters"]
    r = load(worker, f"bad-{case}", path.format(outside=layout["base"] / "outside"))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["reason"] == reason and err["message"]
    assert inventory(worker)["adapters"] == before  # nothing registered, nothing evicted
    assert f"bad-{case}" not in models(worker)
    assert complete(worker, "sql").status_code == 200


def test_absolute_path_inside_root_is_accepted(worker, layout):
    r = load(worker, "legal-abs", str(layout["root"] / "legal"))
    assert r.status_code == 200, r.text
    assert unload(worker, "legal-abs").status_code == 200


# -- lifecycle -----------------------------------------------------------------------------------


def test_load_lists_serves_then_unload_removes(worker, demo_model, demo_adapters):
    r = load(worker, "code-rt", "code")
    assert r.status_code == 200 and r.json()["created"] is True
    assert "code-rt" in models(worker)
    info = next(a for a in inventory(worker)["adapters"] if a["name"] == "code-rt")
    assert info["tier"] in ("cpu", "gpu") and info["rank"] == 32 and info["digest"].startswith("sha256:")
    got = complete(worker, "code-rt").json()["choices"][0]["text"]
    offline = LLMEngine(demo_model, worker.runtime.settings.engine, lora_modules={"code": str(demo_adapters["code"])})
    want = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), [(("code", 1.0),)])[0].text
    assert got == want
    metrics = httpx.get(f"{worker.url}/metrics").text
    assert 'lorafleet:lora_adapter_resident{adapter="code-rt",tier="gpu"} 1.0' in metrics

    again = load(worker, "code-rt", "code")
    assert again.status_code == 200 and again.json()["created"] is False

    assert unload(worker, "code-rt").status_code == 200
    assert "code-rt" not in models(worker)
    assert "code-rt" not in {a["name"] for a in inventory(worker)["adapters"]}
    assert complete(worker, "code-rt").status_code == 404
    assert 'adapter="code-rt"' not in httpx.get(f"{worker.url}/metrics").text
    assert unload(worker, "code-rt").status_code == 404


def test_same_name_different_content_conflicts(worker):
    assert load(worker, "sqlx", "sql_v2").status_code == 200
    r = load(worker, "sqlx", "dora")
    assert r.status_code == 400  # validation first: a bad folder is a 400, not a conflict
    r = load(worker, "sqlx", "poem")
    assert r.status_code == 409 and r.json()["error"]["reason"] == "conflict"
    r = load(worker, "sqlx", "poem", load_inplace=True)
    assert r.status_code == 200 and r.json()["created"] is True
    assert next(a for a in inventory(worker)["adapters"] if a["name"] == "sqlx")["rank"] == 4
    assert unload(worker, "sqlx").status_code == 200


def test_concurrent_identical_loads_load_once(worker):
    async def main():
        async with httpx.AsyncClient(base_url=worker.admin_url, headers=auth()) as http:
            return await asyncio.gather(*(
                http.post("/v1/load_lora_adapter", json={"lora_name": "legal-cc", "lora_path": "legal"})
                for _ in range(12)
            ))

    registry = worker.engine.registry
    reads = []
    real_read = registry.read

    def slow_counting_read(path):  # runs in a worker thread; slow so that all 12 calls overlap
        reads.append(path)
        time.sleep(0.3)
        return real_read(path)

    registry.read = slow_counting_read
    before = loads_metric(worker, "loaded")
    try:
        responses = asyncio.run(main())
    finally:
        del registry.read
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert len(reads) == 1 and loads_metric(worker, "loaded") == before + 1
    assert all(r.json()["created"] for r in responses)  # all shared the one load that created it
    assert unload(worker, "legal-cc").status_code == 200


def test_unload_with_request_in_flight_finishes_it(worker):
    assert load(worker, "poem-fl", "poem").status_code == 200
    body = {"model": "poem-fl", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{worker.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        u = unload(worker, "poem-fl")
        assert u.status_code == 200 and u.json()["requests_in_flight"] == 1
        assert complete(worker, "poem-fl").status_code == 404  # new requests: gone at once
        assert "poem-fl" not in models(worker)
        rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    finals = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in rest[:-1]]
    assert finals[-1] == "length"
    wait_for(lambda: inventory(worker)["num_requests_running"] == 0)


def test_an_adapter_named_after_the_base_model_is_refused(worker):
    """`model: "demo"` means the base model: an adapter under that name could never be asked for,
    and `/v1/models` listed the name twice."""
    r = load(worker, "demo", "poem")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name" and err["reason"] == "base_model_name"
    assert "'demo'" in err["message"] and "base model" in err["message"]
    ids = [m["id"] for m in httpx.get(f"{worker.url}/v1/models").json()["data"]]
    assert ids.count("demo") == 1
    assert "demo" not in {a["name"] for a in inventory(worker)["adapters"]}


def test_validation_error_bodies_are_400(worker):
    for body in ({}, {"lora_name": "x"}, {"lora_name": "../x", "lora_path": "poem"}, {"lora_name": "x", "lora_path": ""}):
        r = httpx.post(f"{worker.admin_url}/v1/load_lora_adapter", json=body, headers=auth())
        assert r.status_code == 400, r.text


# -- separate admin port --------------------------------------------------------------------------


def test_admin_routes_on_their_own_port(demo_model, demo_adapters, layout):
    w = RunningWorker(worker_settings(demo_model, {"sql": demo_adapters["sql"]}, token_file=layout["token"],
                                      adapter_root=layout["root"], admin_port=True)).start()
    try:
        assert w.admin_url != w.url
        assert httpx.get(f"{w.url}/v1/adapters", headers=auth()).status_code == 404
        assert httpx.post(f"{w.url}/v1/load_lora_adapter", headers=auth(),
                          json={"lora_name": "poem", "lora_path": "poem"}).status_code == 404
        assert load(w, "poem", "poem").status_code == 200
        assert "poem" in models(w)
        assert httpx.get(f"{w.admin_url}/health").status_code == 200
        assert httpx.post(f"{w.admin_url}/v1/completions", json={"model": "demo", "prompt": "x"}).status_code == 404
    finally:
        w.stop()


class SlowDigest:
    """A digest still hashing: `value` blocks until `finish()`; records the threads that waited."""

    def __init__(self, value: str) -> None:
        self._value, self._done, self.readers = value, threading.Event(), []

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    @property
    def value(self) -> str:
        if not self._done.is_set():  # a read that waits for the hash
            self.readers.append(threading.current_thread().name)
        self._done.wait(10)
        return self._value

    def finish(self) -> None:
        self._done.set()


def test_the_inventory_never_waits_for_a_digest_on_the_engine_thread(worker, monkeypatch):
    """An adapter registered between the inventory's look for digests still hashing and the
    inventory itself had its digest joined on the engine thread, stalling every request's steps
    for the hash (~0.1 s per 80 MiB). Here a load lands right after the first engine call."""
    entry = worker.engine.registry.entries["chat"]
    real, slow = entry.digest, SlowDigest(entry.digest.value)
    engine = worker.runtime.engine
    calls = []
    original = engine.call

    async def call(fn, *args, **kwargs):
        result = await original(fn, *args, **kwargs)
        if not calls:  # right after the first engine call: a new version registers, hashing
            entry.digest = slow
            threading.Timer(0.3, slow.finish).start()
        calls.append(fn)
        return result

    monkeypatch.setattr(engine, "call", call)
    try:
        inv = httpx.get(f"{worker.url}/v1/adapters", headers=auth(), timeout=30)
        assert inv.status_code == 200
        assert "engine" not in slow.readers, slow.readers
    finally:
        slow.finish()
        entry.digest = real

"""s3:// adapter sources against moto's S3 server on loopback (the real S3 wire protocol, through
boto3): an S3 adapter answers exactly as the same files from a local folder; `sha256` pins the
content (DigestMismatch otherwise, never served); missing objects and prefixes are refused with a
reason; one source asked for twice at once is downloaded once; caps are checked before any
download; the cache is bounded (LRU) and a changed object gets a new folder; unknown schemes are
refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from lorafleet.worker.lora.adapter import AdapterError
from lorafleet.worker.lora.fetch import AdapterFetcher
from lorafleet.worker.lora.sources import HubSource, LocalSource, S3Source, parse_source
from tests.worker.flaky_proxy import FlakyProxy
from tests.worker.worker_harness import (
    TOKEN,
    RunningWorker,
    adapter_inventory,
    greedy_ids,
    load_adapter,
    worker_settings,
)

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

PROMPT = "Every institute uses the same printed textbook"
BUCKET = "adapters"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory, demo_adapters):
    """moto's S3 server on 127.0.0.1, the AWS environment pointing at it, a bucket of adapters."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in (*env, "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN")}
    for k in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)

    def put(prefix: str, folder: Path, files=FILES) -> None:
        for name in files:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(folder / name).read_bytes())

    put("team/poem", demo_adapters["poem"])
    put("team/code", demo_adapters["code"])
    put("team/legal", demo_adapters["legal"])
    put("team/sql", demo_adapters["sql"])
    put("broken/config-only", demo_adapters["sql"], files=FILES[:1])
    client.put_object(Bucket=BUCKET, Key="broken/pickled/adapter_config.json",
                      Body=(demo_adapters["sql"] / FILES[0]).read_bytes())
    client.put_object(Bucket=BUCKET, Key="broken/pickled/adapter_model.bin", Body=b"not really a pickle")
    yield {"client": client, "put": put}
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def worker(s3, demo_model, demo_adapters, tmp_path_factory):
    base = tmp_path_factory.mktemp("s3-worker")
    root = base / "root"
    root.mkdir()
    shutil.copytree(demo_adapters["poem"], root / "poem")
    token = base / "token"
    token.write_text(TOKEN + "\n")
    w = RunningWorker(worker_settings(demo_model, {}, token_file=token, adapter_root=root))
    w.runtime.fetcher = AdapterFetcher(base / "adapter-cache")  # LORAFLEET_ADAPTER_CACHE_DIR's place
    w.start()
    yield w
    w.stop()


load, inventory = load_adapter, adapter_inventory


def greedy(worker, model: str) -> tuple[int, list[str], list[float]]:
    return greedy_ids(worker, model, PROMPT)


def count_gets(fetcher: AdapterFetcher, delay: float = 0.0) -> list[str]:
    """The keys of every GetObject the fetcher's client sends from now on (each held `delay` s first)."""
    keys: list[str] = []

    def seen(params, **_kw) -> None:
        keys.append(params["Key"])
        time.sleep(delay)

    fetcher.client().meta.events.register("provide-client-params.s3.GetObject", seen)
    return keys


# -- parsing ------------------------------------------------------------------------------------------
def test_parse_sources():
    assert parse_source("sql") == LocalSource("sql")
    assert parse_source("/adapters/sql") == LocalSource("/adapters/sql")
    assert parse_source("s3://my-bucket/team/sql") == S3Source("my-bucket", "team/sql/")
    assert parse_source("s3://my-bucket/team/sql/") == S3Source("my-bucket", "team/sql/")
    assert parse_source("S3://my-bucket") == S3Source("my-bucket", "")
    assert parse_source("hf://acme/sql-lora") == HubSource("acme/sql-lora", None)
    assert parse_source("hf://acme/sql-lora@0123abc") == HubSource("acme/sql-lora", "0123abc")
    assert parse_source("hf://acme/loras/sql/v2@refs/pr/3") == HubSource("acme/loras", "refs/pr/3", "sql/v2")
    assert str(parse_source("hf://acme/loras/sql/v2/@main")) == "hf://acme/loras/sql/v2@main"
    for bad, words in [("gs://b/x", "scheme 'gs'"), ("http://x/y", "scheme 'http'"), ("s3://Bad_Bucket/x", "bucket"),
                       ("s3://bkt/../x", "'..'"), ("hf://only-one", "OWNER/NAME"), ("hf://a/b/../c", "'..'"),
                       ("hf://a/b@", "revision")]:
        with pytest.raises(AdapterError) as err:
            parse_source(bad)
        assert err.value.reason == "bad_source" and words in str(err.value), (bad, str(err.value))
    with pytest.raises(AdapterError, match=r"s3://BUCKET/PREFIX or hf://OWNER/NAME"):
        parse_source("ftp://host/x")


# -- through the admin API --------------------------------------------------------------------------
def test_s3_adapter_answers_as_the_local_folder(worker):
    r = load(worker, "poem-s3", f"s3://{BUCKET}/team/poem")
    assert r.status_code == 200 and r.json()["created"] is True, r.text
    assert load(worker, "poem-local", "poem").status_code == 200
    inv = inventory(worker)
    assert inv["poem-s3"]["digest"] == inv["poem-local"]["digest"]
    from_s3, local, base = greedy(worker, "poem-s3"), greedy(worker, "poem-local"), greedy(worker, "demo")
    assert from_s3[0] == 200 and len(from_s3[1]) == 12
    assert from_s3 == local  # the same token ids and logprobs
    assert from_s3[1:] != base[1:]  # and the adapter is applied (this comparison could fail)


def test_sha256_pins_the_content(worker, demo_adapters):
    assert load(worker, "poem-pinned-ref", "poem").status_code == 200
    digest = inventory(worker)["poem-pinned-ref"]["digest"]
    folder = demo_adapters["poem"]  # the digest as docs/worker.md defines it, computed independently
    assert digest == "sha256:" + hashlib.sha256((folder / FILES[0]).read_bytes() + b"\0"
                                                + (folder / FILES[1]).read_bytes() + b"\0").hexdigest()
    r = load(worker, "poem-pinned", f"s3://{BUCKET}/team/poem", sha256=digest.removeprefix("sha256:"))
    assert r.status_code == 200, r.text
    wrong = "0" * 64
    r = load(worker, "legal-pinned", f"s3://{BUCKET}/team/legal", sha256=wrong)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["reason"] == "DigestMismatch" and "digest mismatch" in error["message"]
    assert f"sha256:{wrong}" in error["message"] and "sha256:" + "0" * 64 != error["message"].split()[-1]
    got = error["message"].split("got ")[-1]
    assert len(got) == 71 and got.startswith("sha256:") and got != f"sha256:{wrong}"
    assert "legal-pinned" not in inventory(worker)
    assert greedy(worker, "legal-pinned")[0] == 404  # never served
    # A local folder is pinned the same way.
    r = load(worker, "poem-local-wrong", "poem", sha256=wrong)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "DigestMismatch"
    assert load(worker, "x", "poem", sha256="not-hex").status_code == 400


@pytest.mark.parametrize("path, reason", [
    (f"s3://{BUCKET}/team/nothing-here", "not_found"),
    ("s3://no-such-bucket/team/poem", "not_found"),
    (f"s3://{BUCKET}/broken/config-only", "missing_weights"),
    (f"s3://{BUCKET}/broken/pickled", "pickle"),
    ("gs://bucket/x", "bad_source"),
])
def test_refused_sources_name_a_reason(worker, path, reason):
    r = load(worker, "refused", path)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["reason"] == reason, r.text
    assert "testing-secret" not in r.text
    assert "refused" not in inventory(worker)
    assert greedy(worker, "demo")[0] == 200  # the worker keeps serving


def test_concurrent_loads_of_one_source_download_once(worker):
    # Each GET held 0.5 s: all three loads ask while the one download is under way.
    gets = count_gets(worker.runtime.fetcher, delay=0.5)
    stats = worker.runtime.fetcher.stats
    before, hits = stats.downloads, stats.hits
    scraped = {m: fetch_metric(worker, m) for m in ("misses", "hits", "bytes")}
    barrier = threading.Barrier(3)
    answers: dict[str, httpx.Response] = {}

    def go(name: str) -> None:
        barrier.wait()
        answers[name] = load(worker, name, f"s3://{BUCKET}/team/code")

    threads = [threading.Thread(target=go, args=(n,)) for n in ("code-a", "code-b", "code-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in answers.values()), {n: r.text for n, r in answers.items()}
    assert sorted(gets) == ["team/code/adapter_config.json", "team/code/adapter_model.safetensors"]
    assert stats.downloads == before + 1 and stats.hits == hits  # joined the download, not the cache
    inv = inventory(worker)
    assert inv["code-a"]["digest"] == inv["code-b"]["digest"] == inv["code-c"]["digest"]
    # Asked again later: answered from the cache, no GET.
    assert load(worker, "code-d", f"s3://{BUCKET}/team/code").status_code == 200
    assert len(gets) == 2
    # /metrics: one download of both files, one cache hit.
    size = sum(int(obj["Size"]) for obj in boto3.client("s3").list_objects_v2(
        Bucket=BUCKET, Prefix="team/code/")["Contents"])
    assert fetch_metric(worker, "misses") == scraped["misses"] + 1
    assert fetch_metric(worker, "hits") == scraped["hits"] + 1
    assert fetch_metric(worker, "bytes") == scraped["bytes"] + size


def fetch_metric(worker, counter: str) -> float:
    """lorafleet:adapter_fetch_{cache_misses,cache_hits,bytes}_total{scheme="s3"} on /metrics."""
    name = {"misses": "cache_misses", "hits": "cache_hits", "bytes": "bytes"}[counter]
    for line in httpx.get(f"{worker.url}/metrics").text.splitlines():
        if line.startswith(f'lorafleet:adapter_fetch_{name}_total{{scheme="s3"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the fetcher alone ---------------------------------------------------------------------------------
def test_size_caps_are_checked_before_downloading(s3, tmp_path, demo_adapters):
    fetcher = AdapterFetcher(tmp_path / "cache")
    gets = count_gets(fetcher)
    size = (demo_adapters["sql"] / FILES[1]).stat().st_size
    with pytest.raises(AdapterError) as err:
        fetcher.fetch(S3Source(BUCKET, "team/sql/"), max_bytes=size - 1)
    assert err.value.reason == "too_large" and str(size) in str(err.value)
    assert gets == [] and not any((tmp_path / "cache").glob("*/*"))
    assert Path(fetcher.fetch(S3Source(BUCKET, "team/sql/"), max_bytes=size)).joinpath(FILES[1]).stat().st_size == size


def test_cache_is_bounded_lru_and_keyed_by_content(s3, tmp_path, demo_adapters):
    one = sum((demo_adapters["poem"] / f).stat().st_size for f in FILES)
    fetcher = AdapterFetcher(tmp_path / "cache", max_cache_bytes=int(one * 1.5))
    poem = fetcher.fetch(S3Source(BUCKET, "team/poem/"), 1 << 30)
    # Leased (its caller still reading it): kept even over the bound.
    code = fetcher.fetch(S3Source(BUCKET, "team/code/"), 1 << 30)
    assert Path(poem).is_dir() and Path(code).is_dir() and fetcher.stats.evictions == 0
    fetcher.release(poem)
    fetcher.release(code)
    sql = fetcher.fetch(S3Source(BUCKET, "team/sql/"), 1 << 30)
    fetcher.release(sql)
    assert not Path(poem).exists() and not Path(code).exists() and Path(sql).is_dir()  # least recently used first
    assert fetcher.stats.evictions == 2
    # A folder an adapter is loaded from is kept even over the bound.
    legal = fetcher.fetch(S3Source(BUCKET, "team/legal/"), 1 << 30, protected=lambda: {sql})
    fetcher.release(legal)
    assert Path(sql).is_dir() and Path(legal).is_dir()
    assert not list((tmp_path / "cache").glob(".partial-*"))
    # An object that changes gets a new folder: the old content is never swapped under a path.
    cfg = json.loads((demo_adapters["legal"] / FILES[0]).read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] * 2
    s3["client"].put_object(Bucket=BUCKET, Key="team/legal-mut/adapter_config.json", Body=json.dumps(cfg).encode())
    s3["client"].put_object(Bucket=BUCKET, Key="team/legal-mut/adapter_model.safetensors",
                            Body=(demo_adapters["legal"] / FILES[1]).read_bytes())
    first = fetcher.fetch(S3Source(BUCKET, "team/legal-mut/"), 1 << 30)
    assert fetcher.fetch(S3Source(BUCKET, "team/legal-mut/"), 1 << 30) == first and fetcher.stats.hits == 1
    s3["put"]("team/legal-mut", demo_adapters["legal"])
    second = fetcher.fetch(S3Source(BUCKET, "team/legal-mut/"), 1 << 30)
    assert second != first
    assert (Path(second) / FILES[0]).read_bytes() == (demo_adapters["legal"] / FILES[0]).read_bytes()


def test_missing_boto3_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_boto3(name, *args, **kwargs):
        if name == "boto3" or name.startswith("botocore"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_boto3)
    with pytest.raises(AdapterError, match=r"lorafleet\[sources\]") as err:
        AdapterFetcher(tmp_path).fetch(S3Source(BUCKET, "team/poem/"), 1 << 30)
    assert err.value.reason == "sources_unavailable"


# -- transient errors: retried with back-off, a bounded number of times ---------------------------------
@pytest.fixture
def flaky(s3, monkeypatch):
    """A proxy in front of moto that fails requests on demand; the AWS environment points at it."""
    proxy = FlakyProxy(os.environ["AWS_ENDPOINT_URL_S3"])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    yield proxy
    proxy.stop()


def test_s3_5xx_and_cut_downloads_are_retried(flaky, tmp_path, demo_adapters):
    fetcher = AdapterFetcher(tmp_path / "cache", attempts=3, backoff_s=0.01)
    weights = "/team/code/adapter_model.safetensors"
    flaky.fail("GET", weights, "503", times=2)  # botocore's own retries (standard mode)
    flaky.fail("GET", weights, "cut", times=1)  # the body broken off midway: the fetcher's retry
    folder = Path(fetcher.fetch(S3Source(BUCKET, "team/code/"), 1 << 30))
    assert flaky.seen("GET", weights) == [503, 503, 0, 200]
    for name in FILES:
        assert (folder / name).read_bytes() == (demo_adapters["code"] / name).read_bytes()
    assert fetcher.stats.totals[("retries", "s3", "")] == 1 and fetcher.stats.downloads == 1
    assert not list((tmp_path / "cache").glob(".partial-*"))


def test_s3_that_keeps_failing_is_given_up_on(flaky, tmp_path):
    fetcher = AdapterFetcher(tmp_path / "cache", attempts=3, backoff_s=0.01)
    flaky.fail("GET", f"/{BUCKET}", "503", times=100)
    with pytest.raises(AdapterError) as err:
        fetcher.fetch(S3Source(BUCKET, "team/poem/"), 1 << 30)
    assert err.value.reason == "unavailable" and "ServiceUnavailable" in str(err.value)
    assert flaky.seen("GET", f"/{BUCKET}") == [503] * 3, flaky.requests  # the LIST, tried 3 times in all
    assert fetcher.stats.totals[("errors", "s3", "unavailable")] == 1
    assert "testing-secret" not in str(err.value)

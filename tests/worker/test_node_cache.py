"""A fetch cache shared by several worker processes (the node-wide cache of a LoraPool's
`spec.sources.nodeCache`): one download per content across processes, eviction that spares what
another process holds, and a process killed mid-download that leaves nothing visible and blocks
no one.

The first tests run the fetcher itself in forked processes over a backend that copies local files
(so that a download can be held and killed at will); the last runs two real `lorafleet worker`
processes against moto's S3 server behind a recording proxy."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lorafleet.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.worker.lora.fetch import AdapterFetcher
from lorafleet.worker.lora.remote_files import RemoteFile, Resolved
from lorafleet.worker.lora.sources import S3Source
from tests.worker.flaky_proxy import FlakyProxy
from tests.worker.worker_harness import TOKEN, auth

FORK = multiprocessing.get_context("fork")


class FolderBackend:
    """An `s3` backend over local folders: `s3://b/NAME/` is `root/NAME`. A download of the weights
    waits while `root/hold` exists (a test then kills the process mid-download)."""

    scheme = "s3"

    def __init__(self, root: Path) -> None:
        self.root = root

    def resolve(self, source: S3Source, _max_bytes: int) -> Resolved:
        folder = self.root / source.prefix.strip("/")
        config, weights = (RemoteFile(n, (folder / n).stat().st_size, folder / n) for n in (CONFIG_FILE, WEIGHTS_FILE))
        return Resolved(source.prefix.strip("/"), config, weights)

    def download(self, _source: S3Source, _resolved: Resolved, file: RemoteFile, dest: Path) -> None:
        data = file.ref.read_bytes()
        if file.name == WEIGHTS_FILE:
            dest.write_bytes(data[: len(data) // 2])  # a half-written file, as a download midway
            while (self.root / "hold").exists():
                time.sleep(0.02)
        dest.write_bytes(data)


def fetcher_over(root: Path, cache: Path, max_bytes: int = 1 << 30) -> AdapterFetcher:
    fetcher = AdapterFetcher(cache, max_bytes)
    fetcher.s3 = FolderBackend(root)  # type: ignore[assignment]
    return fetcher


@pytest.fixture
def store(tmp_path, demo_adapters) -> Path:
    root = tmp_path / "store"
    for name in ("poem", "code", "sql"):  # one content under three names: three folders of one size
        shutil.copytree(demo_adapters["code"], root / name)
    return root


def _fetch_and_hold(root: Path, cache: Path, name: str, ready, done) -> None:
    """In a child: fetch `name` and keep it leased until `done` is set."""
    fetcher = fetcher_over(root, cache)
    fetcher.fetch(S3Source("b", f"{name}/"), 1 << 30)
    ready.set()
    done.wait(60)


def test_a_process_killed_mid_download_leaves_nothing_and_blocks_no_one(store, tmp_path, demo_adapters):
    cache = tmp_path / "cache"
    (store / "hold").touch()
    child = FORK.Process(target=_fetch_and_hold, args=(store, cache, "code", FORK.Event(), FORK.Event()))
    child.start()
    deadline = time.monotonic() + 30
    while not any(p.is_dir() and (p / WEIGHTS_FILE).exists() for p in cache.glob(".partial-*")):
        assert time.monotonic() < deadline and child.is_alive(), "the child never started its download"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)  # mid-download, holding the content's lock exclusive
    child.join()
    (store / "hold").unlink()
    assert not (cache / "s3-code").exists()
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []  # nothing visible

    fetcher = fetcher_over(store, cache)
    got: list[str] = []
    thread = threading.Thread(target=lambda: got.append(fetcher.fetch(S3Source("b", "code/"), 1 << 30)), daemon=True)
    thread.start()
    thread.join(30)
    assert got, "a fetch after the killed one waited on its lock"
    folder = Path(got[0])
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (folder / name).read_bytes() == (demo_adapters["code"] / name).read_bytes()
    assert fetcher.stats.downloads == 1
    assert not list(cache.glob(".partial-*")), "the dead process's partial download was not removed"


def test_a_second_process_waits_for_the_download_and_counts_a_hit(store, tmp_path):
    cache = tmp_path / "cache"
    (store / "hold").touch()
    ready, done = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_fetch_and_hold, args=(store, cache, "poem", ready, done))
    child.start()
    try:
        while not list(cache.glob(".partial-*")):
            assert child.is_alive()
            time.sleep(0.02)
        fetcher = fetcher_over(store, cache)
        got: list[str] = []
        thread = threading.Thread(target=lambda: got.append(fetcher.fetch(S3Source("b", "poem/"), 1 << 30)))
        thread.start()
        time.sleep(0.5)
        assert not got, "the second process did not wait for the download under way"
        (store / "hold").unlink()
        thread.join(30)
        assert ready.wait(30) and got
        assert (fetcher.stats.downloads, fetcher.stats.hits) == (0, 1)
    finally:
        done.set()
        child.join(30)


def test_eviction_spares_a_folder_another_process_holds(store, tmp_path):
    cache = tmp_path / "cache"
    size = sum((store / "poem" / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))
    ready, done = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_fetch_and_hold, args=(store, cache, "poem", ready, done))
    child.start()
    assert ready.wait(30)
    # Room for one folder: this process's fetches would evict "poem" first (not its own, the oldest).
    fetcher = fetcher_over(store, cache, max_bytes=size + size // 2)
    code = fetcher.fetch(S3Source("b", "code/"), 1 << 30)
    fetcher.release(code)
    assert (cache / "s3-poem").is_dir(), "evicted a folder another process holds"
    done.set()
    child.join(30)
    # The holder gone (its lock dropped with it): "poem" may go now, "code" (not protected) as well.
    sql = fetcher.fetch(S3Source("b", "sql/"), 1 << 30)
    assert not (cache / "s3-poem").exists() and not (cache / "s3-code").exists() and Path(sql).is_dir()
    assert fetcher.stats.evictions == 2


# -- two real worker processes sharing one cache folder ------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_proxy(demo_adapters):
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing-secret", "region_name": "us-east-1"}
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **creds)
    client.create_bucket(Bucket="adapters")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        client.put_object(Bucket="adapters", Key=f"team/code/{name}", Body=(demo_adapters["code"] / name).read_bytes())
    proxy = FlakyProxy(f"http://127.0.0.1:{port}")
    yield proxy
    proxy.stop()
    server.stop()


def _start_worker(demo_model: Path, tmp_path: Path, i: int, cache: Path, endpoint: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    root = tmp_path / "adapters"
    root.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing-secret", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL_S3=endpoint, LORAFLEET_ADAPTER_CACHE_DIR=str(cache), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "lorafleet", "worker", "--model", str(demo_model), "--served-model-name", "demo",
            "--host", "127.0.0.1", "--port", str(port), "--adapter-root", str(root), "--admin-token-file", str(token),
            "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    log = open(tmp_path / f"worker-{i}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'{name}{{scheme="s3"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_two_worker_processes_sharing_a_cache_fetch_once(s3_proxy, demo_model, tmp_path):
    cache = tmp_path / "node-cache"
    procs = [_start_worker(demo_model, tmp_path, i, cache, s3_proxy.url) for i in range(2)]
    try:
        deadline = time.monotonic() + 180
        for proc, url in procs:
            while True:
                assert proc.poll() is None, (tmp_path / "worker-0.log").read_text()[-3000:]
                try:
                    if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "workers not ready"
                time.sleep(0.2)
        # Each object GET held 1 s: both loads are asked while the one download runs.
        s3_proxy.slow("GET", "/adapters/team/code/adapter_", 1.0)
        barrier = threading.Barrier(2)
        answers: dict[str, httpx.Response] = {}

        def load(url: str) -> None:
            barrier.wait()
            answers[url] = httpx.post(f"{url}/v1/load_lora_adapter", headers=auth(), timeout=120,
                                      json={"lora_name": "code", "lora_path": "s3://adapters/team/code"})

        threads = [threading.Thread(target=load, args=(url,)) for _p, url in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in answers.values()), {u: r.text for u, r in answers.items()}
        # The store saw each object fetched once, for both workers.
        assert s3_proxy.seen("GET", "/adapters/team/code/adapter_model.safetensors") == [200]
        assert s3_proxy.seen("GET", "/adapters/team/code/adapter_config.json") == [200]
        urls = [url for _p, url in procs]
        assert sum(_metric(u, "lorafleet:adapter_fetch_cache_misses_total") for u in urls) == 1
        assert sum(_metric(u, "lorafleet:adapter_fetch_cache_hits_total") for u in urls) == 1
        # Both serve it, alike.
        outs = []
        for url in urls:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "code", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["text"])
        assert outs[0] == outs[1]
        assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] and not list(cache.glob(".partial-*"))
    finally:
        for proc, _url in procs:
            proc.terminate()
        for proc, _url in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

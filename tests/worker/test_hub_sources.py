"""hf:// adapter sources against a Hub stand-in on loopback (tests/worker/fake_hub.py) that speaks the
Hub's file API the way huggingface_hub calls it: an adapter from the Hub answers exactly as the same
files from a local folder; a revision pins a commit; a repo folder is a source; `sha256` pins the
content; missing repos, revisions and files, private repos without a token and gated repos are
refused with a reason, the token in no answer and no log line; one source asked for twice at once is
downloaded once; transient errors are retried with back-off, a bounded number of times; the fetch
metrics on /metrics count it all."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from lorafleet.worker.lora.adapter import AdapterError
from lorafleet.worker.lora.fetch import AdapterFetcher
from lorafleet.worker.lora.sources import HubSource
from tests.worker.fake_hub import FakeHub
from tests.worker.worker_harness import (
    TOKEN,
    RunningWorker,
    adapter_inventory,
    greedy_ids,
    load_adapter,
    worker_settings,
)

pytest.importorskip("huggingface_hub")

HF_TOKEN = "hf_secretTokenValue0123456789"
PROMPT = "Every institute uses the same printed textbook"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def files_of(folder: Path, under: str = "") -> dict[str, bytes]:
    return {f"{under}{name}": (folder / name).read_bytes() for name in FILES}


def digest_of(folder: Path) -> str:
    """The worker's digest as docs/adapters.md defines it, computed independently."""
    return "sha256:" + hashlib.sha256((folder / FILES[0]).read_bytes() + b"\0"
                                      + (folder / FILES[1]).read_bytes() + b"\0").hexdigest()


@pytest.fixture(scope="module")
def hub(demo_adapters):
    hub = FakeHub(token=HF_TOKEN).start()
    hub.commits = {
        "poem": hub.push("acme/poem-lora", files_of(demo_adapters["poem"]) | {"README.md": b"# poem\n"}),
        "multi": hub.push("acme/loras", files_of(demo_adapters["code"], "code/") | files_of(demo_adapters["sql"], "sql/v2/")),
    }
    hub.push("acme/private-lora", files_of(demo_adapters["legal"]), private=True)
    hub.push("acme/gated-lora", files_of(demo_adapters["legal"]), gated=True)
    hub.push("acme/config-only", {FILES[0]: (demo_adapters["sql"] / FILES[0]).read_bytes()})
    hub.push("acme/pickled", {FILES[0]: (demo_adapters["sql"] / FILES[0]).read_bytes(), "adapter_model.bin": b"x"})
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def worker(hub, demo_model, demo_adapters, tmp_path_factory):
    base = tmp_path_factory.mktemp("hub-worker")
    root = base / "root"
    root.mkdir()
    for name in ("poem", "sql"):
        shutil.copytree(demo_adapters[name], root / name)
    token = base / "token"
    token.write_text(TOKEN + "\n")
    w = RunningWorker(worker_settings(demo_model, {}, token_file=token, adapter_root=root))
    # HF_ENDPOINT's and HF_TOKEN's places; back-off short for the tests.
    w.runtime.fetcher = AdapterFetcher(base / "adapter-cache", hub_endpoint=hub.url, hub_token=HF_TOKEN,
                                       attempts=3, backoff_s=0.01)
    w.start()
    yield w
    w.stop()


load, inventory = load_adapter, adapter_inventory


def greedy(worker, model: str) -> tuple[int, list[str], list[float]]:
    return greedy_ids(worker, model, PROMPT)


def metric(worker, name: str, **labels) -> float:
    """A sample's value on /metrics (0 if absent)."""
    text = httpx.get(f"{worker.url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")) or (
                want and line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- through the admin API --------------------------------------------------------------------------
def test_hub_adapter_answers_as_the_local_folder(worker, hub, demo_adapters):
    r = load(worker, "poem-hf", "hf://acme/poem-lora")
    assert r.status_code == 200 and r.json()["created"] is True, r.text
    assert load(worker, "poem-local", "poem").status_code == 200
    inv = inventory(worker)
    assert inv["poem-hf"]["digest"] == inv["poem-local"]["digest"] == digest_of(demo_adapters["poem"])
    from_hub, local, base = greedy(worker, "poem-hf"), greedy(worker, "poem-local"), greedy(worker, "demo")
    assert from_hub[0] == 200 and len(from_hub[1]) == 12
    assert from_hub == local  # the same token ids and logprobs
    assert from_hub[1:] != base[1:]  # and the adapter is applied
    # Both files fetched at the resolved commit, with the token; README.md not fetched.
    gets = hub.seen("GET", "/acme/poem-lora/resolve/")
    assert sorted(g.path.rsplit("/", 1)[1] for g in gets) == sorted(FILES)
    assert all(f"/resolve/{hub.commits['poem']}/" in g.path for g in gets)
    assert all(g.authorization == f"Bearer {HF_TOKEN}" for g in gets)


def test_subfolders_and_revisions(worker, hub, demo_adapters):
    r = load(worker, "sql-hf", f"hf://acme/loras/sql/v2@{hub.commits['multi']}")
    assert r.status_code == 200, r.text
    assert load(worker, "sql-local", "sql").status_code == 200
    inv = inventory(worker)
    assert inv["sql-hf"]["digest"] == inv["sql-local"]["digest"] == digest_of(demo_adapters["sql"])
    assert greedy(worker, "sql-hf") == greedy(worker, "sql-local")
    # main moves to other content: the pinned commit still gives the old, @main the new.
    moved = hub.push("acme/loras", files_of(demo_adapters["legal"], "sql/v2/"))
    assert load(worker, "sql-pinned", f"hf://acme/loras/sql/v2@{hub.commits['multi']}").status_code == 200
    assert load(worker, "sql-main", "hf://acme/loras/sql/v2@main").status_code == 200
    inv = inventory(worker)
    assert inv["sql-pinned"]["digest"] == digest_of(demo_adapters["sql"])
    assert inv["sql-main"]["digest"] == digest_of(demo_adapters["legal"])
    assert load(worker, "sql-moved", f"hf://acme/loras/sql/v2@{moved}").status_code == 200


def test_sha256_pins_hub_content(worker, demo_adapters):
    want = digest_of(demo_adapters["code"])
    r = load(worker, "code-pinned", "hf://acme/loras/code", sha256=want.removeprefix("sha256:"))
    assert r.status_code == 200, r.text
    wrong = "f" * 64
    r = load(worker, "code-wrong", "hf://acme/loras/code", sha256=wrong)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["reason"] == "DigestMismatch" and "digest mismatch" in error["message"]
    assert f"sha256:{wrong}" in error["message"] and want in error["message"]
    assert "code-wrong" not in inventory(worker) and greedy(worker, "code-wrong")[0] == 404


@pytest.mark.parametrize("path, reason, words", [
    ("hf://acme/no-such-repo", "not_found", "no such repo"),
    ("hf://acme/poem-lora@no-such-branch", "not_found", "revision 'no-such-branch' not found"),
    ("hf://acme/loras/no/such/folder", "not_found", "has no files"),
    ("hf://acme/config-only", "missing_weights", "adapter_model.safetensors"),
    ("hf://acme/pickled", "pickle", "pickle"),
    ("hf://acme/a/b@..", "bad_source", "revision"),
])
def test_refused_hub_sources_name_a_reason(worker, caplog, path, reason, words):
    caplog.set_level(logging.DEBUG)
    r = load(worker, "refused", path)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["reason"] == reason and words in r.json()["error"]["message"], r.text
    assert HF_TOKEN not in r.text and HF_TOKEN not in caplog.text
    assert "refused" not in inventory(worker)
    assert greedy(worker, "demo")[0] == 200  # the worker keeps serving


def test_private_and_gated_repos(hub, tmp_path, caplog, monkeypatch, demo_adapters):
    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login either
    anonymous = AdapterFetcher(tmp_path / "a", hub_endpoint=hub.url, attempts=1)
    for source, words in [(HubSource("acme/private-lora", None), "no HF_TOKEN is set"),
                          (HubSource("acme/gated-lora", None), "gated")]:
        with pytest.raises(AdapterError) as err:
            anonymous.fetch(source, 1 << 30)
        assert err.value.reason == "access_denied" and words in str(err.value), str(err.value)
    wrong = AdapterFetcher(tmp_path / "w", hub_endpoint=hub.url, hub_token="hf_wrong", attempts=1)
    with pytest.raises(AdapterError, match="wrong or expired token") as err:
        wrong.fetch(HubSource("acme/private-lora", None), 1 << 30)
    assert err.value.reason == "access_denied"
    # With the token: fetched, and the token is in no log line.
    folder = AdapterFetcher(tmp_path / "t", hub_endpoint=hub.url, hub_token=HF_TOKEN).fetch(
        HubSource("acme/private-lora", None), 1 << 30)
    assert (Path(folder) / FILES[1]).read_bytes() == (demo_adapters["legal"] / FILES[1]).read_bytes()
    assert HF_TOKEN not in caplog.text


def test_concurrent_loads_of_one_source_download_once(worker, hub):
    before = len(hub.seen("GET", "/acme/loras/resolve/"))
    downloads = worker.runtime.fetcher.stats.downloads
    misses = metric(worker, "lorafleet:adapter_fetch_cache_misses_total", scheme="hf")
    barrier = threading.Barrier(3)
    answers: dict[str, httpx.Response] = {}

    def go(name: str) -> None:
        barrier.wait()
        answers[name] = load(worker, name, f"hf://acme/loras/code@{hub.commits['multi']}")

    threads = [threading.Thread(target=go, args=(n,)) for n in ("code-a", "code-b", "code-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in answers.values()), {n: r.text for n, r in answers.items()}
    gets = hub.seen("GET", "/acme/loras/resolve/")[before:]
    assert sorted(g.path.rsplit("/", 1)[1] for g in gets) == sorted(FILES)  # each file once
    assert worker.runtime.fetcher.stats.downloads == downloads + 1
    assert metric(worker, "lorafleet:adapter_fetch_cache_misses_total", scheme="hf") == misses + 1
    # Asked again later: from the cache (the listing is asked, no file).
    hits = metric(worker, "lorafleet:adapter_fetch_cache_hits_total", scheme="hf")
    assert load(worker, "code-d", f"hf://acme/loras/code@{hub.commits['multi']}").status_code == 200
    assert len(hub.seen("GET", "/acme/loras/resolve/")) == before + 2
    assert metric(worker, "lorafleet:adapter_fetch_cache_hits_total", scheme="hf") == hits + 1


def test_transient_errors_are_retried_with_backoff(worker, hub, demo_adapters):
    retries = metric(worker, "lorafleet:adapter_fetch_retries_total", scheme="hf")
    fetched = metric(worker, "lorafleet:adapter_fetch_bytes_total", scheme="hf")
    seconds = metric(worker, "lorafleet:adapter_fetch_seconds_count", scheme="hf")
    commit = hub.push("acme/flaky-lora", files_of(demo_adapters["code"]))
    hub.fail("GET", "/api/models/acme/flaky-lora", "503", times=2)  # the listing fails twice
    hub.fail("GET", "/acme/flaky-lora/resolve/", "502", times=2)  # and the first file's download twice
    r = load(worker, "flaky", "hf://acme/flaky-lora")
    assert r.status_code == 200, r.text
    assert [s.status for s in hub.seen("GET", "/api/models/acme/flaky-lora")] == [503, 503, 200]
    assert inventory(worker)["flaky"]["digest"] == digest_of(demo_adapters["code"])
    assert metric(worker, "lorafleet:adapter_fetch_retries_total", scheme="hf") == retries + 4
    size = sum((demo_adapters["code"] / f).stat().st_size for f in FILES)
    assert metric(worker, "lorafleet:adapter_fetch_bytes_total", scheme="hf") == fetched + size
    assert metric(worker, "lorafleet:adapter_fetch_seconds_count", scheme="hf") == seconds + 1
    # Bounded: a Hub that keeps failing is given up on after `attempts` (3) tries, with a reason.
    errors = metric(worker, "lorafleet:adapter_fetch_errors_total", scheme="hf", reason="unavailable")
    hub.fail("GET", "/api/models/acme/flaky-lora", "503", times=10)
    seen = len(hub.seen("GET", "/api/models/acme/flaky-lora"))
    r = load(worker, "flaky-2", f"hf://acme/flaky-lora@{commit}")
    assert r.status_code in (502, 503, 400) and r.json()["error"]["reason"] == "unavailable", r.text
    assert "gave up after 3 attempts" in r.json()["error"]["message"]
    assert len(hub.seen("GET", "/api/models/acme/flaky-lora")) == seen + 3
    assert metric(worker, "lorafleet:adapter_fetch_errors_total", scheme="hf", reason="unavailable") == errors + 1
    hub.faults.clear()


def test_a_download_cut_off_midway_is_completed(hub, tmp_path, demo_adapters):
    hub.push("acme/cut-lora", files_of(demo_adapters["poem"]))
    hub.fail("GET", "/acme/cut-lora/resolve/", "reset", times=1)
    fetcher = AdapterFetcher(tmp_path / "c", hub_endpoint=hub.url, hub_token=HF_TOKEN, backoff_s=0.01)
    folder = Path(fetcher.fetch(HubSource("acme/cut-lora", None), 1 << 30))
    for name in FILES:
        assert (folder / name).read_bytes() == (demo_adapters["poem"] / name).read_bytes()
    assert not list((tmp_path / "c").glob(".partial-*"))  # nothing partial left visible


def test_caps_before_download(hub, tmp_path, demo_adapters):
    fetcher = AdapterFetcher(tmp_path / "caps", hub_endpoint=hub.url, hub_token=HF_TOKEN)
    size = (demo_adapters["poem"] / FILES[1]).stat().st_size
    before = len(hub.seen("GET", "/resolve/"))
    with pytest.raises(AdapterError) as err:
        fetcher.fetch(HubSource("acme/poem-lora", None), max_bytes=size - 1)
    assert err.value.reason == "too_large" and str(size) in str(err.value)
    assert len(hub.seen("GET", "/resolve/")) == before and not any((tmp_path / "caps").glob("*/*"))


# -- the digest: the worker's, the CLI's and the documented one-liner's -------------------------------
def documented_one_liner() -> str:
    """The one-liner docs/worker.md gives for the digest (the test runs what the docs say)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "worker.md").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("python -c 'import hashlib")]
    assert len(lines) == 1 and lines[0].endswith(" FOLDER"), lines
    return sys.executable + lines[0].removeprefix("python").removesuffix(" FOLDER")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorafleet", "adapters", "digest", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_cli_digest_is_the_workers_and_the_documented_one(worker, hub, demo_adapters):
    folder = demo_adapters["sql"]
    assert load(worker, "sql-for-digest", "sql").status_code == 200
    reported = inventory(worker)["sql-for-digest"]["digest"]
    cli = run_cli(str(folder))
    assert cli.returncode == 0, cli.stderr
    assert "sha256:" + cli.stdout.strip() == reported
    one_liner = subprocess.run(["bash", "-c", f"{documented_one_liner()} {folder}"], capture_output=True, text=True,
                               timeout=60)
    assert one_liner.returncode == 0, one_liner.stderr
    assert "sha256:" + one_liner.stdout.strip() == reported
    # Remote sources through the worker's fetcher (HF_ENDPOINT and HF_TOKEN from the environment);
    # several sources: "HEX  SOURCE" lines.
    cli = run_cli(str(demo_adapters["poem"]), "hf://acme/loras/sql/v2@" + hub.commits["multi"],
                  env={"HF_ENDPOINT": hub.url, "HF_TOKEN": HF_TOKEN})
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == [f"{digest_of(demo_adapters['poem'])[7:]}  {demo_adapters['poem']}",
                                       f"{reported[7:]}  hf://acme/loras/sql/v2@{hub.commits['multi']}"]
    assert HF_TOKEN not in cli.stdout + cli.stderr
    bad = run_cli(str(demo_adapters["poem"].parent), "hf://acme/no-such-repo", env={"HF_ENDPOINT": hub.url})
    assert bad.returncode == 1 and "not a PEFT adapter folder" in bad.stderr and "hf://acme/no-such-repo" in bad.stderr

"""`lorafleet up` with adapters from S3 (moto's S3 server on loopback) and the Hugging Face Hub (the
Hub stand-in of tests/worker/fake_hub.py), applied as LoraAdapter manifests with `spec.source:
s3://...|hf://...` and `spec.sha256`:

- they load and answer exactly as the same files on the local volume;
- a wrong sha256 is refused (DigestMismatch) and never served;
- a missing object or repo is refused with a reason;
- an object changed after the first load is not served by a new replica under the old digest: the
  first fetched digest is what every replica must load;
- the fleet keeps serving the other adapters throughout;
- a worker asked for content it already fetched fetches nothing (its cache, by content)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.common.test_local_fleet import Fleet, free_port, start_fleet, stop_fleet
from tests.worker.fake_hub import FakeHub

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("huggingface_hub")

BUCKET = "adapters"
FILES = ("adapter_config.json", "adapter_model.safetensors")
HF_TOKEN = "hf_localFleetToken0123456789"
PROMPT = "SELECT name FROM"


def digest_of(folder: Path) -> str:
    return hashlib.sha256((folder / FILES[0]).read_bytes() + b"\0" + (folder / FILES[1]).read_bytes() + b"\0").hexdigest()


@pytest.fixture
def stores(demo_adapters, monkeypatch) -> Iterator[tuple]:
    """moto's S3 and the Hub stand-in, the fleet's environment pointing at them."""
    port = free_port()
    s3 = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    s3.start()
    hub = FakeHub(token=HF_TOKEN).start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "HF_ENDPOINT": hub.url, "HF_TOKEN": HF_TOKEN,
           "LORAFLEET_ADAPTER_FETCH_ATTEMPTS": "2"}
    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"])
    client.create_bucket(Bucket=BUCKET)

    def put(prefix: str, folder: Path) -> None:
        for name in FILES:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(folder / name).read_bytes())

    put("team/poem", demo_adapters["poem"])
    put("team/legal", demo_adapters["legal"])
    put("team/mut", demo_adapters["code"])
    hub.push("acme/sql-lora", {name: (demo_adapters["sql"] / name).read_bytes() for name in FILES})
    yield put, hub
    hub.stop()
    s3.stop()


@pytest.fixture
def fleet(stores, tmp_path, demo_assets) -> Iterator[Fleet]:
    fleet = start_fleet(tmp_path, free_port(), demo_assets, "--no-redis")
    yield fleet
    if fleet.process.poll() is None:
        stop_fleet(fleet)


def manifest(name: str, source: str, replicas: int = 1, sha256: str | None = None) -> str:
    pin = f", sha256: '{sha256}'" if sha256 else ""
    return (f"apiVersion: lorafleet.dev/v1alpha1\nkind: LoraAdapter\nmetadata: {{name: {name}}}\n"
            f"spec: {{pool: local, source: '{source}', replicas: {{min: {replicas}, max: {replicas}}}{pin}}}\n---\n")


def answer(fleet: Fleet, model: str) -> tuple[int, list]:
    """Status, and the greedy tokens with their logprobs."""
    r = httpx.post(f"{fleet.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    if r.status_code != 200:
        return r.status_code, []
    lp = r.json()["choices"][0]["logprobs"]
    return 200, list(zip(lp["tokens"], lp["token_logprobs"], strict=True))


def status_of(fleet: Fleet, name: str) -> dict:
    got = fleet.adapters("get", name, "-o", "json")
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout).get("status") or {}


def failed_condition(status: dict) -> tuple[str, str]:
    for cond in status.get("conditions") or ():
        if cond.get("status") == "False" and cond.get("message"):
            return cond.get("reason", ""), cond["message"]
    return "", ""


def workers(fleet: Fleet) -> list[dict]:
    return json.loads((fleet.run_dir / "state.json").read_text())["workers"]


def inventories(fleet: Fleet) -> dict[str, dict[str, str]]:
    """worker -> adapter -> digest, from each worker's admin inventory."""
    token = (fleet.run_dir / "admin-token").read_text().strip()
    out = {}
    for w in workers(fleet):
        r = httpx.get(f"{w['url']}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200, r.text
        out[w["name"]] = {a["name"]: a["digest"] for a in r.json()["adapters"]}
    return out


def fetch_totals(fleet: Fleet, metric: str, **labels: str) -> float:
    """A fetch counter summed over the workers' /metrics."""
    total = 0.0
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for w in workers(fleet):
        for line in httpx.get(f"{w['url']}/metrics", timeout=30).text.splitlines():
            if re.match(re.escape(metric) + r"[{ ]", line) and all(x in line for x in want):
                total += float(line.rsplit(" ", 1)[1])
    return total


def apply(fleet: Fleet, text: str, wait: int = 90):
    return fleet.adapters("apply", "-f", "-", "--wait", str(wait), stdin=text)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_remote_adapters_in_the_local_fleet(fleet, stores, demo_adapters):
    put, hub = stores
    baseline = {name: answer(fleet, name) for name in ("poem", "sql", "code", "chat")}
    assert all(status == 200 for status, _ in baseline.values()), baseline

    # From S3 on both workers, from the Hub pinned by sha256: the answers of the same files on the volume.
    sql_digest = digest_of(demo_adapters["sql"])
    applied = apply(fleet, manifest("s3-poem", f"s3://{BUCKET}/team/poem", replicas=2)
                    + manifest("hf-sql", "hf://acme/sql-lora@main", sha256=sql_digest))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert answer(fleet, "s3-poem") == baseline["poem"]
    assert answer(fleet, "hf-sql") == baseline["sql"]
    held = inventories(fleet)
    assert all(inv.get("s3-poem") == "sha256:" + digest_of(demo_adapters["poem"]) for inv in held.values()), held

    # The same content under another name, on both workers: fetched nowhere again (each worker's cache).
    misses = fetch_totals(fleet, "lorafleet:adapter_fetch_cache_misses_total", scheme="s3")
    hits = fetch_totals(fleet, "lorafleet:adapter_fetch_cache_hits_total", scheme="s3")
    assert misses == 2  # one download per worker
    applied = apply(fleet, manifest("s3-poem-copy", f"s3://{BUCKET}/team/poem", replicas=2))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert fetch_totals(fleet, "lorafleet:adapter_fetch_cache_misses_total", scheme="s3") == misses
    assert fetch_totals(fleet, "lorafleet:adapter_fetch_cache_hits_total", scheme="s3") == hits + 2

    # A wrong sha256: refused before serving, with both digests named; a missing object or repo: refused.
    wrong = "0" * 64
    refused = apply(fleet, manifest("s3-wrong", f"s3://{BUCKET}/team/legal", sha256=wrong)
                    + manifest("s3-missing", f"s3://{BUCKET}/team/nothing-here")
                    + manifest("hf-missing", "hf://acme/no-such-repo"), wait=60)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    reason, message = failed_condition(status_of(fleet, "s3-wrong"))
    assert reason == "DigestMismatch" and "digest mismatch" in message, (reason, message)
    assert wrong in message and digest_of(demo_adapters["legal"]) in message
    assert answer(fleet, "s3-wrong")[0] == 404
    assert "no objects under this prefix" in failed_condition(status_of(fleet, "s3-missing"))[1]
    assert "no such repo" in failed_condition(status_of(fleet, "hf-missing"))[1]
    assert HF_TOKEN not in refused.stdout + refused.stderr + json.dumps(status_of(fleet, "hf-missing"))
    for inv in inventories(fleet).values():
        assert not {"s3-wrong", "s3-missing", "hf-missing"} & set(inv)
    assert answer(fleet, "sql") == baseline["sql"]  # the others keep serving

    # Loaded once, then the objects change: a new replica must load the first content or nothing.
    code_digest = "sha256:" + digest_of(demo_adapters["code"])
    applied = apply(fleet, manifest("s3-mut", f"s3://{BUCKET}/team/mut", replicas=1))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert answer(fleet, "s3-mut") == baseline["code"]
    put("team/mut", demo_adapters["legal"])
    refusals = fetch_totals(fleet, "lorafleet:lora_admin_loads_total", result="DigestMismatch")
    apply(fleet, manifest("s3-mut", f"s3://{BUCKET}/team/mut", replicas=2), wait=20)
    deadline = time.monotonic() + 60
    while fetch_totals(fleet, "lorafleet:lora_admin_loads_total", result="DigestMismatch") == refusals:
        assert time.monotonic() < deadline, "no second replica of s3-mut was tried"
        time.sleep(0.5)
    for inv in inventories(fleet).values():
        assert inv.get("s3-mut", code_digest) == code_digest, inv  # never the changed content
    for _ in range(3):
        assert answer(fleet, "s3-mut") == baseline["code"]
    assert answer(fleet, "poem") == baseline["poem"] and answer(fleet, "s3-poem") == baseline["poem"]
    assert stop_fleet(fleet) == 0

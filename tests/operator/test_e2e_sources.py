"""LoraAdapters from S3 through the operator, with real `lorafleet worker` processes as the pods and
moto's S3 server on loopback (the real S3 wire protocol, through the workers' boto3).

The workers get the store's endpoint and credentials only from the pool's Secret
(`spec.sources.credentialsSecretRef`, `secretKeyRef` env resolved by the test kubelet): this process's
environment holds no AWS settings, so a fetch that works proves the Secret reached the worker.
Checked: an s3:// adapter answers exactly as the same files on the volume; a wrong sha256 is
refused (Failed, DigestMismatch, both digests) and never served; a missing prefix or object, and a
bucket or Hub owner outside the pool's allow-lists, are refused with their reasons; an object changed after the first
load is not served by a new replica under the recorded digest; a volume adapter serves throughout;
the Secret's values appear in no object, event, operator log or worker log.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorafleet.operator.builders import read_token
from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.real_worker import RealWorker, RealWorkerFactory
from tests.operator.test_e2e import adapter_manifest, apply, status
from tests.operator.test_e2e_real_workers import pool_manifest

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "adapters"
FILES = ("adapter_config.json", "adapter_model.safetensors")
ACCESS_KEY = "AKIA" + secrets.token_hex(8).upper()
SECRET_KEY = "op52-" + secrets.token_urlsafe(24)  # must appear nowhere but in the worker's environment
PROMPT = "Every institute uses the same printed textbook"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3(demo_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """moto on 127.0.0.1 with a bucket of the demo adapters; no AWS settings in this environment."""
    import os

    for key in list(os.environ):
        if key.startswith(("AWS_", "HF_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata probe on a laptop
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)

    def put(prefix: str, folder: Path) -> None:
        for name in FILES:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(folder / name).read_bytes())

    for name in ("poem", "sql", "legal"):
        put(f"team/{name}", demo_adapters[name])
    client.put_object(Bucket=BUCKET, Key="team/halfway/adapter_config.json",  # no weights object
                      Body=(demo_adapters["sql"] / FILES[0]).read_bytes())
    yield {"endpoint": endpoint, "put": put}
    server.stop()


@pytest.fixture
async def s3_kubelet(api: PatchedEmulator, tmp_path: Path) -> AsyncIterator[tuple[Kubelet, RealWorkerFactory]]:
    factory = RealWorkerFactory(tmp_path / "pods", secrets=lambda name: api.get("v1/secrets", "default", name))
    async with Kubelet(api, worker_factory=factory, grace_s=0.5) as kubelet:
        yield kubelet, factory
    assert factory.leftovers() == [], "worker processes outlived the test"


def credentials_secret(endpoint: str) -> dict[str, Any]:
    values = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
              "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": "adapter-store"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}}


async def inventory(api: PatchedEmulator, kubelet: Kubelet) -> dict[str, dict[str, str]]:
    """Pod -> {adapter: digest} as each real worker reports it."""
    token = read_token(api.get("v1/secrets", "default", "pool-admin-token"))
    out: dict[str, dict[str, str]] = {}
    async with httpx.AsyncClient(timeout=10.0, headers={"Authorization": f"Bearer {token}"}) as http:
        for pod in list(kubelet.pods.values()):
            r = await http.get(f"{pod.worker.admin_url}/v1/adapters")
            r.raise_for_status()
            out[pod.name] = {a["name"]: a["digest"] for a in r.json()["adapters"]}
    return out


async def greedy(worker: RealWorker, model: str) -> tuple[int, list[str], list[float]]:
    async with httpx.AsyncClient(timeout=60.0) as http:
        r = await http.post(f"{worker.url}/v1/completions", json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True})
    if r.status_code != 200:
        return r.status_code, [], []
    lp = r.json()["choices"][0]["logprobs"]
    return 200, lp["tokens"], lp["token_logprobs"]


def ready_condition(api: PatchedEmulator, name: str) -> dict[str, Any]:
    return next(c for c in status(api, name).get("conditions", []) if c["type"] == "Ready")


async def test_s3_adapters_through_the_operator(
    api: PatchedEmulator, kubectl: Kubectl, s3_kubelet: tuple[Kubelet, RealWorkerFactory], operator: OperatorRunner,
    tmp_path: Path, demo_model: Path, demo_adapters: dict[str, Path], s3: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    kubelet, factory = s3_kubelet
    root = tmp_path / "adapters"
    shutil.copytree(demo_adapters["poem"], root / "poem")
    pool = pool_manifest(demo_model, root, replicas=2)
    pool["spec"]["sources"] = {"credentialsSecretRef": {"name": "adapter-store"}, "allowedBuckets": [BUCKET],
                               "cacheBytes": 1 << 30}
    remote = {
        "s3poem": f"s3://{BUCKET}/team/poem", "s3sql": f"s3://{BUCKET}/team/sql", "legal": f"s3://{BUCKET}/team/legal",
        "wrongsha": f"s3://{BUCKET}/team/sql", "missing": f"s3://{BUCKET}/team/nothing-here",
        "outside": "s3://another-bucket/team/poem", "halfway": f"s3://{BUCKET}/team/halfway",
        "stranger": "hf://stranger/poem-lora@main",
    }
    manifests = [adapter_manifest(name, source=source, credentialsSecretRef={"name": "adapter-store"})
                 for name, source in remote.items()]
    next(m for m in manifests if m["metadata"]["name"] == "wrongsha")["spec"]["sha256"] = "0" * 64
    await apply(kubectl, tmp_path, credentials_secret(s3["endpoint"]), pool, adapter_manifest("poem", 2, 2), *manifests)

    good = ("poem", "s3poem", "s3sql", "legal")
    def phases() -> dict[str, Any]:
        return {n: (status(api, n).get("phase"), [(c["reason"], c["message"]) for c in status(api, n).get("conditions", [])
                                                  if c["type"] == "Ready"]) for n in good}

    try:
        await eventually(lambda: all(p == "Ready" for p, _ in phases().values()) or kubelet.errors, timeout=90)
    except AssertionError:
        raise AssertionError(phases()) from None
    assert not kubelet.errors, kubelet.errors
    workers = {p.name: p.worker for p in kubelet.pods.values()}

    # The volume adapter serves on both workers from now to the end.
    failures: list[Any] = []

    async def keep_serving() -> None:
        while True:
            for worker in list(workers.values()):
                code, tokens, _ = await greedy(worker, "poem")
                if code != 200 or len(tokens) != 8:
                    failures.append((worker.pod, code))
            await asyncio.sleep(0.2)

    serving = asyncio.create_task(keep_serving())
    try:
        inv = await inventory(api, kubelet)
        # The same files from S3 and from the volume: the same digest and the same answers.
        s3poem_pod = next(p for p, names in inv.items() if "s3poem" in names)
        assert inv[s3poem_pod]["s3poem"] == inv[s3poem_pod]["poem"]
        assert status(api, "s3poem")["digest"] == inv[s3poem_pod]["poem"]
        from_s3, from_volume = await greedy(workers[s3poem_pod], "s3poem"), await greedy(workers[s3poem_pod], "poem")
        assert from_s3[:2] == from_volume[:2] and from_s3[0] == 200  # the same tokens
        # and the same log-probabilities, to float32 rounding (the batch around each request differs)
        assert from_s3[2] == pytest.approx(from_volume[2], abs=1e-4)

        # Refused with a reason before serving: a wrong sha256, a missing prefix, a bucket not allowed.
        refused = (("wrongsha", "DigestMismatch"), ("missing", "SourceNotFound"), ("halfway", "SourceNotFound"),
                   ("outside", "SourceNotAllowed"), ("stranger", "SourceNotAllowed"))
        for name, reason in refused:
            await eventually(lambda n=name: status(api, n).get("phase") == "Failed", timeout=30)
            cond = ready_condition(api, name)
            assert (cond["status"], cond["reason"]) == ("False", reason), cond
        message = ready_condition(api, "wrongsha")["message"]
        assert "digest mismatch" in message and f"sha256:{'0' * 64}" in message, message
        assert status(api, "s3sql")["digest"] in message, message  # the content's own digest
        assert "another-bucket" in ready_condition(api, "outside")["message"]
        assert "adapter_model.safetensors" in ready_condition(api, "halfway")["message"]
        assert "Hub owner 'stranger'" in ready_condition(api, "stranger")["message"]
        inv = await inventory(api, kubelet)
        for name, _reason in refused:
            assert not any(name in names for names in inv.values()), inv
            for worker in workers.values():
                assert (await greedy(worker, name))[0] == 404
        logs = "".join((factory.root / pod / "worker.log").read_text() for pod in workers)
        assert "another-bucket" not in logs and "stranger" not in logs  # refused by the policy before any load

        # The object behind "legal" changes after its first load: a new replica fetches the new
        # bytes, which differ from the digest recorded in status, and does not serve them.
        recorded = status(api, "legal")["digest"]
        holder = next(p for p, names in inv.items() if "legal" in names)
        other = next(p for p in workers if p != holder)
        s3["put"]("team/legal", demo_adapters["chat"])
        await kubectl("patch", "loraadapter", "legal", "--type=merge", "-p",
                      json.dumps({"spec": {"replicas": {"min": 2, "max": 2}}}))
        log_of_other = factory.root / other / "worker.log"
        await eventually(lambda: "digest mismatch" in log_of_other.read_text() and "legal" in log_of_other.read_text(),
                         timeout=30)
        await asyncio.sleep(2.0)  # a few more rounds: none of them may land the new bytes anywhere
        inv = await inventory(api, kubelet)
        assert inv[holder]["legal"] == recorded and "legal" not in inv[other], inv
        assert status(api, "legal")["digest"] == recorded
        assert status(api, "legal")["readyReplicas"] == 1
        legal = status(api, "legal")
        cond = ready_condition(api, "legal")
        assert (legal["phase"], cond["status"], cond["reason"]) == ("Degraded", "False", "DigestMismatch"), legal
        assert f"expected {recorded}" in cond["message"] and "digest mismatch" in cond["message"], cond
        assert (await greedy(workers[holder], "legal"))[0] == 200
        assert (await greedy(workers[other], "legal"))[0] == 404
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
    assert failures == [], failures

    # The Secret's values are in the Secret only: no custom resource, event, workload, pod, operator
    # log line or worker log line holds them (nor their base64).
    needles = [ACCESS_KEY, SECRET_KEY] + [base64.b64encode(v.encode()).decode() for v in (ACCESS_KEY, SECRET_KEY)]
    kinds = set()
    for (resource, _ns, _name), obj in list(api.objects.items()):
        if "secrets" in str(resource):
            continue
        kinds.add(str(resource))
        dumped = json.dumps(obj.raw)
        assert not any(n in dumped for n in needles), (resource, _name)
    assert any("loraadapters" in k for k in kinds), kinds
    # kopf posts its `kopf.objects` log records as the objects' Events: the captured log holds them.
    assert "kopf.objects" in caplog.text
    # This process's log also holds the test's own S3 client and moto (botocore logs its signed
    # requests at DEBUG): only those are allowed the credentials.
    leaks = [(r.name, r.getMessage()[:200]) for r in caplog.records
             if any(n in r.getMessage() for n in needles) and not r.name.startswith(("botocore", "moto", "werkzeug",
                                                                                      "urllib3", "s3transfer", "boto3"))]
    assert leaks == []
    logs = "".join((factory.root / pod / "worker.log").read_text() for pod in workers)
    assert not any(n in logs for n in needles)
    # The pods reference the Secret by name and key, never a value.
    deployment = api.get("apps/v1/deployments", "default", "pool")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs["AWS_SECRET_ACCESS_KEY"] == {"name": "adapter-store", "key": "AWS_SECRET_ACCESS_KEY", "optional": True}

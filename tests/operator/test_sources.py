"""Remote adapter sources on the operator's side (operator/sources.py): the CRD's CEL rules on
`spec.source` use the operator's own expressions and agree with its parser; a pool's allow-lists and
credentials are checked before any load; the worker pods reference the pool's Secret by name and
key only; every load carries the digest it must have."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet.operator import sources
from lorafleet.operator.builders import pod_template, workload
from lorafleet.operator.spec import SpecError, check_against_pool, parse_adapter, parse_pool
from lorafleet.operator.worker_client import LoadRefused

ROOT = Path(__file__).resolve().parents[2]
POOL = {"model": {"path": "/models/m", "servedName": "m"}, "image": "w:1"}
SHA = "ab" * 32


def source_rules() -> list[dict[str, str]]:
    crd = yaml.safe_load((ROOT / "crds" / "loraadapters.lorafleet.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["source"]["x-kubernetes-validations"]


def cel_accepts(source: str) -> tuple[bool, str]:
    """The CRD's rules on `spec.source`, evaluated for the forms they use (startsWith, matches,
    split/exists): RE2 and Python's re agree on these expressions."""
    for rule in source_rules():
        expr = rule["rule"]
        env = {"self": source}

        def matches(m: re.Match) -> str:
            return repr(re.search(m.group(1), source) is not None)

        py = re.sub(r"self\.matches\('((?:[^'\\]|\\.)*)'\)", matches, expr)
        py = re.sub(r"self\.startsWith\('([^']*)'\)", lambda m: repr(source.startswith(m.group(1))), py)
        py = py.replace("self.split('/').exists(p, p == '..')", repr(".." in source.split("/")))
        py = py.replace("!", " not ").replace("||", " or ").replace("&&", " and ")
        if not eval(py, {}, env):  # noqa: S307 - the CRD's own expressions, rewritten above
            return False, rule["message"]
    return True, ""


def test_the_crd_rules_use_the_operators_expressions() -> None:
    text = " ".join(r["rule"] for r in source_rules())
    for pattern in (sources.SCHEME, sources.S3_SOURCE, sources.HF_SOURCE):
        assert f"'{pattern}'" in text, pattern


@pytest.mark.parametrize(("source", "ok", "words"), [
    ("sql", True, ""),
    ("team/sql-v2", True, ""),
    ("s3://team-adapters/sql", True, ""),
    ("s3://team-adapters/a/b/c/", True, ""),
    ("s3://team.adapters", True, ""),
    ("hf://my-org/sql-lora", True, ""),
    ("hf://my-org/sql-lora@v1.2", True, ""),
    ("hf://my-org/sql-lora@0123456789abcdef0123456789abcdef01234567", True, ""),
    ("hf://my-org/repo/adapters/sql@main", True, ""),
    ("ftp://host/sql", False, "other schemes are not supported"),
    ("https://example.com/sql", False, "other schemes are not supported"),
    ("gs://bucket/sql", False, "other schemes are not supported"),
    ("s3://Bucket/sql", False, "valid bucket name"),
    ("s3://ab/sql", False, "valid bucket name"),
    ("s3://bucket/sql?versionId=1", False, "without '?'"),
    ("s3://bucket/../other", False, "'..'"),
    ("hf://my-org", False, "hf://OWNER/NAME"),
    ("hf://my-org/repo@", False, "hf://OWNER/NAME"),
    ("/etc/passwd", False, "relative"),
    ("a/../../b", False, "'..'"),
])
def test_sources_the_crd_and_the_operator_accept(source: str, ok: bool, words: str) -> None:
    accepted, message = cel_accepts(source)
    assert accepted is ok, (source, message)
    assert words in message
    spec = {"pool": "p", "source": source}
    if ok:
        assert parse_adapter("ns", "a", spec).source == source
    else:  # an object from a lax API server: the operator refuses it too
        with pytest.raises(SpecError) as info:
            parse_adapter("ns", "a", spec)
        assert info.value.reason in ("InvalidSource", "SourceOutsideVolume")


def pool(**extra: Any):
    return parse_pool("ns", "p", {**POOL, **extra})


def adapter(source: str, **extra: Any):
    return parse_adapter("ns", "a", {"pool": "p", "source": source, **extra})


@pytest.mark.parametrize(("source", "pool_sources", "reason", "words"), [
    ("s3://team-adapters/sql", None, "SourceNotAllowed", "no spec.sources"),
    ("s3://team-adapters/sql", {"allowedHubOwners": ["my-org"]}, "SourceNotAllowed", "bucket 'team-adapters'"),
    ("s3://other/sql", {"allowedBuckets": ["team-adapters"]}, "SourceNotAllowed", "allowedBuckets: team-adapters"),
    ("hf://someone/sql", {"allowedHubOwners": ["my-org"]}, "SourceNotAllowed", "Hub owner 'someone'"),
    ("s3://team-adapters/sql", {"allowedBuckets": ["team-adapters"]}, None, ""),
    ("s3://anything/sql", {"allowedBuckets": ["*"]}, None, ""),
    ("hf://my-org/sql@main", {"allowedHubOwners": ["my-org"]}, None, ""),
    ("sql", None, None, ""),  # the volume: no policy
])
def test_the_pools_allow_lists_are_checked_before_any_load(source, pool_sources, reason, words) -> None:
    p = pool(sources=pool_sources) if pool_sources is not None else pool()
    if reason is None:
        check_against_pool(adapter(source), p)
        return
    with pytest.raises(SpecError) as info:
        check_against_pool(adapter(source), p)
    assert info.value.reason == reason and words in str(info.value), str(info.value)


def test_an_adapters_credentials_must_be_the_pools() -> None:
    p = pool(sources={"credentialsSecretRef": {"name": "store"}, "allowedBuckets": ["b-1"]})
    check_against_pool(adapter("s3://b-1/x", credentialsSecretRef={"name": "store"}), p)
    with pytest.raises(SpecError) as info:
        check_against_pool(adapter("s3://b-1/x", credentialsSecretRef={"name": "mine"}), p)
    assert info.value.reason == "CredentialsNotOnPool"
    assert "'mine'" in str(info.value) and "'store'" in str(info.value)


def test_stock_vllm_pools_refuse_remote_sources() -> None:
    p = pool(server={"kind": "vllm"}, sources={"allowedBuckets": ["*"]})
    with pytest.raises(SpecError) as info:
        check_against_pool(adapter("s3://b-1/x"), p)
    assert info.value.reason == "SourceUnsupported"


def test_worker_pods_reference_the_secret_and_get_a_bounded_cache() -> None:
    p = pool(sources={"credentialsSecretRef": {"name": "store"}, "allowedBuckets": ["b-1"], "cacheBytes": 1 << 30},
             serviceAccountName="adapter-reader")
    template = pod_template(p)
    spec = template["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    for key in sources.CREDENTIAL_KEYS:
        assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {"name": "store", "key": key, "optional": True}}}
    assert env["LORAFLEET_ADAPTER_CACHE_DIR"]["value"] == sources.CACHE_MOUNT
    assert env["LORAFLEET_ADAPTER_CACHE_BYTES"]["value"] == str(1 << 30)
    cache = next(v for v in spec["volumes"] if v["name"] == sources.CACHE_VOLUME)
    assert int(cache["emptyDir"]["sizeLimit"]) > 1 << 30
    assert {"name": sources.CACHE_VOLUME, "mountPath": sources.CACHE_MOUNT} in container["volumeMounts"]
    assert spec["serviceAccountName"] == "adapter-reader" and spec["automountServiceAccountToken"] is False
    assert "envFrom" not in container  # only the standard names: no key of the Secret becomes LD_PRELOAD


def test_a_pool_without_sources_keeps_its_pod_template() -> None:
    template = workload(pool())["spec"]["template"]
    assert "env" not in template["spec"]["containers"][0]
    assert all(v["name"] != sources.CACHE_VOLUME for v in template["spec"]["volumes"])
    assert "serviceAccountName" not in template["spec"]


@pytest.mark.parametrize(("spec_sha", "source", "target", "kind", "pin"), [
    (SHA, "sql", f"sha256:{SHA}", "lorafleet", SHA),  # the spec's sha256, any source
    (None, "s3://b-1/x", f"sha256:{SHA}", "lorafleet", SHA),  # a remote source: the recorded digest
    (None, "hf://o/n", f"sha256:{SHA}", "lorafleet", SHA),
    (None, "s3://b-1/x", None, "lorafleet", None),  # its first load
    (None, "sql", f"sha256:{SHA}", "lorafleet", None),  # the volume follows its files
    (SHA, "sql", f"sha256:{SHA}", "vllm", None),  # stock vLLM has no digests
])
def test_the_digest_each_load_carries(spec_sha, source, target, kind, pin) -> None:
    assert sources.load_pin(spec_sha, source, target, kind) == pin


@pytest.mark.parametrize(("worker_reason", "status", "reason"), [
    ("DigestMismatch", 400, "DigestMismatch"),
    ("not_found", 400, "SourceNotFound"),
    ("missing_weights", 400, "SourceNotFound"),
    ("access_denied", 400, "SourceAccessDenied"),
    ("no_credentials", 400, "SourceAccessDenied"),
    ("bad_rank", 400, "LoadRefused"),
    (None, 409, "ContentConflict"),
])
def test_the_workers_refusals_name_their_reason(worker_reason, status, reason) -> None:
    assert LoadRefused(status, "m", worker_reason).reason == reason


@pytest.mark.parametrize("raw", [
    {"cacheBytes": 10},
    {"allowedBuckets": "b-1"},
    {"credentialsSecretRef": "store"},
])
def test_bad_pool_sources_are_refused(raw: dict) -> None:
    with pytest.raises(SpecError):
        pool(sources=raw)


SOURCE = "s3://b-1/a"


def remote_reconciler(status: dict | None = None):
    from lorafleet.operator.pool_state import PodState
    from lorafleet.operator.reconciler import PoolReconciler
    from lorafleet.operator.spec import PoolSpec
    from tests.operator.reconciler_stubs import NOW, PODS, RecordingStore, StubWorkers

    events: list[tuple] = []
    workers = StubWorkers(events)
    reconciler = PoolReconciler("ns", "pool", workers, None, RecordingStore(events), url_of=lambda pod, _p: pod.name,
                                clock=lambda: NOW)
    allow = sources.SourcesSpec(enabled=True, allowed_buckets=("b-1",))
    reconciler.set_pool(PoolSpec("ns", "pool", "img", "/model", "base", sources=allow), "token")
    for pod in PODS:
        reconciler.observe_pod(PodState(pod, "10.0.0.1", ready=True, draining=False))
    return reconciler, workers


def respec_remote(reconciler, replicas: int, status: dict | None = None) -> None:
    spec = parse_adapter("ns", "a", {"pool": "pool", "source": SOURCE, "replicas": {"min": replicas, "max": replicas}})
    reconciler.upsert_adapter(spec, replicas, status)


async def test_an_object_changed_after_its_first_load_is_not_served_by_a_new_replica() -> None:
    from tests.operator.reconciler_stubs import digest_of

    reconciler, workers = remote_reconciler()
    respec_remote(reconciler, 1)
    await reconciler.reconcile_once()
    first = digest_of(SOURCE)
    (home,) = [pod for pod, held in workers.held.items() if "a" in held]
    assert reconciler.adapters["a"].status["digest"] == first  # recorded
    assert workers.held[home]["a"].path == SOURCE  # the worker is asked for the source itself

    workers.changed[SOURCE] = "sha256:" + "cd" * 32  # the object is replaced in the bucket
    respec_remote(reconciler, 2)
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    other = next(pod for pod in workers.held if pod != home)
    assert "a" not in workers.held[other] and workers.held[home]["a"].digest == first
    status = reconciler.adapters["a"].status
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (status["phase"], status["digest"], ready["reason"]) == ("Degraded", first, "DigestMismatch")
    assert f"expected {first}" in ready["message"] and "cd" * 32 in ready["message"]

    # After an operator restart the pin comes from status.digest.
    restarted, workers2 = remote_reconciler()
    workers2.held[home]["a"] = workers.held[home]["a"]
    workers2.changed[SOURCE] = workers.changed[SOURCE]
    respec_remote(restarted, 2, status={"phase": "Degraded", "source": SOURCE, "digest": first})
    for _ in range(2):
        restarted.wake(resync=True)
        await restarted.reconcile_once()
    assert "a" not in workers2.held[other] and workers2.held[home]["a"].digest == first


async def test_a_copy_of_changed_bytes_loaded_behind_the_operator_is_unloaded() -> None:
    """A router's cold load reads the catalog's source without a digest: if the object changed, that
    copy holds other bytes than the recorded digest; its pinned reload is refused, so it is unloaded."""
    from tests.operator.reconciler_stubs import digest_of, info

    reconciler, workers = remote_reconciler()
    respec_remote(reconciler, 1)
    await reconciler.reconcile_once()
    (home,) = [pod for pod, held in workers.held.items() if "a" in held]
    other = next(pod for pod in workers.held if pod != home)
    changed = "sha256:" + "ef" * 32
    workers.changed[SOURCE] = changed
    workers.held[other]["a"] = info("a", path=SOURCE).model_copy(update={"digest": changed})
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert "a" not in workers.held[other]
    assert workers.held[home]["a"].digest == digest_of(SOURCE)


def test_the_pools_own_env_wins_over_the_secrets_key() -> None:
    p = pool(sources={"credentialsSecretRef": {"name": "store"}},
             env=[{"name": "AWS_ENDPOINT_URL_S3", "value": "http://minio:9000"}])
    env = pod_template(p)["spec"]["containers"][0]["env"]
    mine = [e for e in env if e["name"] == "AWS_ENDPOINT_URL_S3"]
    assert mine == [{"name": "AWS_ENDPOINT_URL_S3", "value": "http://minio:9000"}]
    assert any(e["name"] == "AWS_SECRET_ACCESS_KEY" for e in env)

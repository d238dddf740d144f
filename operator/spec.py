"""LoraPool / LoraAdapter specs as frozen dataclasses, parsed from the custom resources' dicts.

The CRD schema (crds/) rejects most mistakes at `kubectl apply`; `parse_*` re-check what the
operator relies on, because objects may predate a schema change or come from a lax API server.
A `SpecError` is permanent: the object is marked Failed and not retried until it changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from lorafleet.operator.server_spec import InvalidServer, ServerSpec, parse_server
from lorafleet.operator.sources import (
    CACHE_MOUNT,
    InvalidSource,
    SourcesSpec,
    check_policy,
    check_source,
    parse_sources,
    secret_name,
)

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POOL_LABEL = f"{GROUP}/pool"

_SHA256 = re.compile(r"^[a-f0-9]{64}$")


class SpecError(ValueError):
    """A manifest the operator cannot act on; `reason` is the CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# The worker's --tool-call-parser formats (worker/openai/tools.py PARSERS; tests/operator/test_builders.py
# checks they agree; the operator does not import the worker).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # the worker's --reasoning-parser (worker/openai/reasoning.py PARSERS)

@dataclass(frozen=True, slots=True)
class EngineSpec:
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    max_loras_per_request: int = 4
    device: str = "cuda"
    dtype: str = "auto"
    tool_call_parser: str | None = None  # chat's tool_choice "auto" (worker --tool-call-parser)
    reasoning_parser: str | None = None  # chat answers' reasoning split out (worker --reasoning-parser)


@dataclass(frozen=True, slots=True)
class PodFields:
    """Worker pod fields passed through unchanged (core/v1 shapes; the API server validates them on the pods)."""

    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class: str | None = None
    runtime_class: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()


# Volume names and mount paths the operator's own pod template uses (builders.py).
RESERVED_VOLUMES = ("admin-token", "adapters", "model", "adapter-cache")
TOKEN_MOUNT = "/var/run/lorafleet/admin"
GPU_RESOURCE = "nvidia.com/gpu"
SHM_MOUNT = "/dev/shm"  # tensorParallelSize > 1: NCCL's shared-memory transport (a memory-backed emptyDir)
MODEL_MOUNT = "/models"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    namespace: str
    name: str
    image: str
    model_path: str
    served_name: str
    model_claim: str | None = None
    replicas: int = 2
    tensor_parallel_size: int = 1  # spec.tensorParallelSize: GPUs per worker pod, the model sharded over them
    workload_kind: str = "Deployment"
    image_pull_policy: str = "IfNotPresent"
    resources: Mapping[str, Mapping[str, Any]] | None = None
    engine: EngineSpec = EngineSpec()
    adapter_claim: str | None = None
    adapter_mount: str = "/adapters"
    http_port: int = 8000
    admin_port: int = 8001
    requests_per_replica: float = 5.0
    max_unavailable: int | str = 1
    server: ServerSpec = ServerSpec()  # spec.server: our worker, or a stock vLLM (operator/vllm_pods.py)
    pod: PodFields = PodFields()
    sources: SourcesSpec = SourcesSpec()  # spec.sources: remote adapter sources (operator/sources.py)
    service_account: str | None = None  # spec.serviceAccountName (IRSA / pod identity)

    @property
    def token_secret(self) -> str:
        return f"{self.name}-admin-token"

    @property
    def selector(self) -> dict[str, str]:
        return {POOL_LABEL: self.name}


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    namespace: str
    name: str
    pool: str
    source: str
    sha256: str | None = None
    rank: int | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    pinned: bool = False
    tenants: tuple[str, ...] = ()
    credentials_secret: str | None = None  # spec.credentialsSecretRef.name: must be the pool's


_MISSING = object()
# A LoraPool's name names its Deployment/StatefulSet, headless Service (an RFC 1035 label) and the
# pod label `lorafleet.dev/pool`; a StatefulSet's `controller-revision-hash` label (`<name>-<10>`)
# caps it at 52 characters. The CRD's schema has the same rule.
_POOL_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
POOL_NAME_MAX = 52
_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")  # the CRD's pattern


def _mapping(raw: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError("InvalidSpec", f"{where}{key} must be an object, not {type(value).__name__}")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int, lo: int, hi: int, where: str) -> int:
    """An integer field within [lo, hi]; wrong types and ranges are a SpecError naming the field."""
    value = raw.get(key, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError("InvalidSpec", f"{where}{key} must be an integer, not {value!r}")
    if not lo <= value <= hi:
        raise SpecError("InvalidSpec", f"{where}{key} must be between {lo} and {hi}, not {value}")
    return value


def _str(raw: Mapping[str, Any], key: str, default: str | None, where: str, choices: tuple[str, ...] = ()) -> str | None:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise SpecError("InvalidSpec", f"{where}{key} must be a string, not {value!r}")
    if choices and value not in choices:
        raise SpecError("InvalidSpec", f"{where}{key} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _bool(raw: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):  # bool("false") is True: never coerce
        raise SpecError("InvalidSpec", f"{where}{key} must be true or false, not {value!r}")
    return value


def check_pool_name(name: str) -> None:
    if len(name) > POOL_NAME_MAX or not _POOL_NAME.match(name):
        raise SpecError(
            "InvalidName",
            f"LoraPool name {name!r} must be a DNS label of at most {POOL_NAME_MAX} characters "
            "(lowercase letters, digits, '-'; starting with a letter): it names the workers' Service",
        )


def parse_pool(namespace: str, name: str, spec: Mapping[str, Any]) -> PoolSpec:
    check_pool_name(name)
    model = _mapping(spec, "model", "spec.")
    if not spec.get("image"):
        raise SpecError("MissingImage", "spec.image is required")
    if not model.get("path") or not model.get("servedName"):
        raise SpecError("MissingModel", "spec.model.path and spec.model.servedName are required")
    engine_raw = _mapping(spec, "engine", "spec.")
    where = "spec.engine."
    engine = EngineSpec(
        max_loras=_int(engine_raw, "maxLoras", 4, 1, 256, where),
        max_cpu_loras=_int(engine_raw, "maxCpuLoras", 16, 1, 4096, where),
        max_lora_rank=_int(engine_raw, "maxLoraRank", 64, 1, 1024, where),
        max_loras_per_request=_int(engine_raw, "maxLorasPerRequest", 0, 1, 16, where),
        device=str(_str(engine_raw, "device", "cuda", where, ("cpu", "cuda"))),
        dtype=str(_str(engine_raw, "dtype", "auto", where, ("auto", "float16", "bfloat16", "float32"))),
        tool_call_parser=_str(engine_raw, "toolCallParser", "", where, ("", *TOOL_CALL_PARSERS)) or None,
        reasoning_parser=_str(engine_raw, "reasoningParser", "", where, ("", *REASONING_PARSERS)) or None,
    )
    if engine.max_loras > engine.max_cpu_loras:
        raise SpecError("InvalidEngine", "engine.maxLoras must be <= engine.maxCpuLoras")
    # The worker's own default (--max-loras-per-request): min(4, --max-loras); more than maxLoras
    # could never be batched, so the worker refuses it at start-up: refused here first.
    if not engine.max_loras_per_request:
        engine = replace(engine, max_loras_per_request=min(4, engine.max_loras))
    elif engine.max_loras_per_request > engine.max_loras:
        raise SpecError("InvalidEngine", "engine.maxLorasPerRequest must be <= engine.maxLoras")
    volume = _mapping(spec, "adapterVolume", "spec.")
    ports = _mapping(spec, "ports", "spec.")
    placement = _mapping(spec, "placement", "spec.")
    resources = _mapping(spec, "resources", "spec.")
    for key in resources:
        _mapping(resources, key, "spec.resources.")
    rate = placement.get("requestsPerReplica", 5.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise SpecError("InvalidSpec", f"spec.placement.requestsPerReplica must be a number > 0, not {rate!r}")
    mount = str(_str(volume, "mountPath", "/adapters", "spec.adapterVolume."))
    if not mount.startswith("/"):
        raise SpecError("InvalidSpec", f"spec.adapterVolume.mountPath must be absolute, not {mount!r}")
    try:
        server = parse_server(spec)
    except InvalidServer as exc:
        raise SpecError("InvalidSpec", str(exc)) from None
    try:
        sources = parse_sources(spec)
    except InvalidSource as exc:
        raise SpecError(exc.reason, str(exc)) from None
    ports_given = dict(ports)
    if server.kind == "vllm":  # one port: vLLM serves its LoRA endpoints beside generation
        ports_given["admin"] = _int(ports, "http", 8000, 1, 65535, "spec.ports.")
    pool = PoolSpec(
        namespace=namespace,
        name=name,
        image=str(spec["image"]),
        model_path=str(model["path"]),
        served_name=str(model["servedName"]),
        model_claim=_str(model, "claimName", None, "spec.model.") or None,
        replicas=_int(spec, "replicas", 2, 0, 1000, "spec."),
        tensor_parallel_size=_int(spec, "tensorParallelSize", 1, 1, 16, "spec."),
        workload_kind=str(_str(spec, "workloadKind", "Deployment", "spec.", ("Deployment", "StatefulSet"))),
        image_pull_policy=str(_str(spec, "imagePullPolicy", "IfNotPresent", "spec.", ("Always", "IfNotPresent", "Never"))),
        resources=resources or None,
        engine=engine,
        adapter_claim=_str(volume, "claimName", None, "spec.adapterVolume.") or None,
        adapter_mount=mount,
        http_port=_int(ports, "http", 8000, 1, 65535, "spec.ports."),
        admin_port=_int(ports_given, "admin", 8001, 1, 65535, "spec.ports."),
        requests_per_replica=float(rate),
        max_unavailable=_max_unavailable(spec.get("maxUnavailable", 1)),
        server=server,
        pod=parse_pod_fields(spec),
        sources=sources,
        service_account=_str(spec, "serviceAccountName", None, "spec.") or None,
    )
    if pool.http_port == pool.admin_port and server.kind != "vllm":
        raise SpecError("InvalidPorts", "ports.http and ports.admin must differ")
    gpus = ((pool.resources or {}).get("limits") or {}).get(GPU_RESOURCE)
    if pool.tensor_parallel_size > 1 and gpus is not None and str(gpus) != str(pool.tensor_parallel_size):
        raise SpecError("InvalidSpec", f"spec.resources.limits {GPU_RESOURCE}={gpus} but spec.tensorParallelSize="
                        f"{pool.tensor_parallel_size}: each worker needs one GPU per rank (leave the limit out: "
                        "the operator sets it)")
    own = {TOKEN_MOUNT, pool.adapter_mount} | ({MODEL_MOUNT} if pool.model_claim else set()) | (
        {CACHE_MOUNT} if sources.enabled else set())
    if pool.tensor_parallel_size > 1:
        own.add(SHM_MOUNT)
    clash = sorted({str(m["mountPath"]).rstrip("/") for m in pool.pod.volume_mounts} & own)
    if clash:
        raise SpecError("InvalidSpec", f"spec.volumeMounts: {', '.join(clash)} is where the operator mounts its own volumes")
    return pool


def _objects(raw: Mapping[str, Any], key: str, required: tuple[str, ...] = ()) -> tuple[Mapping[str, Any], ...]:
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise SpecError("InvalidSpec", f"spec.{key} must be a list of objects")
    for i, item in enumerate(value):
        for field in required:
            if not isinstance(item.get(field), str) or not item.get(field):
                raise SpecError("InvalidSpec", f"spec.{key}[{i}].{field} is required")
    return tuple(value)


def parse_pod_fields(spec: Mapping[str, Any]) -> PodFields:
    """spec's worker pod fields; only what the operator relies on is checked (names, references)."""
    node_selector = _mapping(spec, "nodeSelector", "spec.")
    if not all(isinstance(v, str) for v in node_selector.values()):
        raise SpecError("InvalidSpec", "spec.nodeSelector values must be strings")
    volumes = _objects(spec, "volumes", ("name",))
    names = [v["name"] for v in volumes]
    taken = sorted(set(names) & set(RESERVED_VOLUMES))
    if taken:
        raise SpecError("InvalidSpec", f"spec.volumes: {', '.join(taken)} are the operator's own volume names")
    if len(set(names)) != len(names):
        raise SpecError("InvalidSpec", "spec.volumes: names must be unique")
    mounts = _objects(spec, "volumeMounts", ("name", "mountPath"))
    for m in mounts:
        if m["name"] not in names:
            raise SpecError("InvalidSpec", f"spec.volumeMounts: {m['name']!r} is not in spec.volumes")
    secrets = _objects(spec, "imagePullSecrets", ("name",))
    affinity = _mapping(spec, "affinity", "spec.")
    return PodFields(
        node_selector=dict(node_selector) or None,
        tolerations=_objects(spec, "tolerations"),
        affinity=dict(affinity) or None,
        priority_class=_str(spec, "priorityClassName", None, "spec.") or None,
        runtime_class=_str(spec, "runtimeClassName", None, "spec.") or None,
        image_pull_secrets=tuple(s["name"] for s in secrets),
        env=_objects(spec, "env", ("name",)),
        volumes=volumes,
        volume_mounts=mounts,
    )


def _max_unavailable(value: Any) -> int | str:
    """A PodDisruptionBudget's maxUnavailable: a count >= 0 or a percentage ("25%")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _PERCENT.match(value):
        return value
    raise SpecError("InvalidSpec", f"spec.maxUnavailable must be a count >= 0 or a percentage like '25%', not {value!r}")


def parse_adapter(namespace: str, name: str, spec: Mapping[str, Any]) -> AdapterSpec:
    pool = spec.get("pool")
    source = spec.get("source")
    if not pool:
        raise SpecError("MissingPool", "spec.pool is required")
    if not isinstance(pool, str):
        raise SpecError("InvalidSpec", f"spec.pool must be a string, not {pool!r}")
    if not source or not isinstance(source, str):
        raise SpecError("MissingSource", "spec.source is required")
    try:
        check_source(source)
        credentials = secret_name(spec.get("credentialsSecretRef"), "spec.")
    except InvalidSource as exc:
        raise SpecError(exc.reason, str(exc)) from None
    replicas = _mapping(spec, "replicas", "spec.")
    lo = _int(replicas, "min", 1, 0, 1000, "spec.replicas.")
    hi = _int(replicas, "max", 1, 1, 1000, "spec.replicas.")
    if lo > hi:
        raise SpecError("InvalidReplicas", f"replicas.min ({lo}) must be between 0 and replicas.max ({hi})")
    sha = spec.get("sha256")
    if sha is not None and not (isinstance(sha, str) and _SHA256.match(sha)):
        raise SpecError("InvalidDigest", "sha256 must be 64 lowercase hex digits")
    tenants = spec.get("tenants") or ()
    if not isinstance(tenants, (list, tuple)) or not all(isinstance(t, str) and t for t in tenants):
        raise SpecError("InvalidSpec", f"spec.tenants must be a list of tenant names, not {tenants!r}")
    rank = spec.get("rank")
    return AdapterSpec(
        namespace=namespace,
        name=name,
        pool=pool,
        source=source,
        sha256=sha,
        rank=_int(spec, "rank", 0, 1, 1024, "spec.") if rank is not None else None,
        min_replicas=lo,
        max_replicas=hi,
        pinned=_bool(spec, "pinned", False, "spec."),
        tenants=tuple(tenants),
        credentials_secret=credentials,
    )


def check_against_pool(adapter: AdapterSpec, pool: PoolSpec) -> None:
    """Checks that need the pool; raise before any load so nothing is evicted for a doomed adapter."""
    if adapter.name == pool.served_name:  # `model=<name>` would mean the base model: never this adapter
        raise SpecError(
            "NameIsBaseModel",
            f"adapter name {adapter.name!r} is pool {pool.name}'s base model name (spec.model.servedName); rename it",
        )
    if adapter.rank is not None and adapter.rank > pool.engine.max_lora_rank:
        raise SpecError(
            "RankTooHigh",
            f"rank {adapter.rank} exceeds pool {pool.name}'s maxLoraRank {pool.engine.max_lora_rank}",
        )
    if adapter.sha256 is not None and pool.server.kind == "vllm":
        raise SpecError(
            "DigestUnverifiable",
            f"pool {pool.name} runs stock vLLM, which reports no adapter digests: spec.sha256 cannot be "
            "checked there (remove it, or pin the content by its source path)",
        )
    try:
        check_policy(adapter.source, adapter.credentials_secret, pool.name, pool.sources, pool.server.kind)
    except InvalidSource as exc:
        raise SpecError(exc.reason, str(exc)) from None


def same_digest(a: str, b: str) -> bool:
    """Two sha256 digests, each bare hex or "sha256:<hex>", in either case."""
    return a.lower().removeprefix("sha256:") == b.lower().removeprefix("sha256:")


def digest_matches(expected_hex: str | None, reported: str) -> bool:
    """Workers report "sha256:<hex>"; the manifest holds the bare hex (None: anything matches)."""
    return expected_hex is None or same_digest(reported, expected_hex)


def model_dir(pool: PoolSpec) -> str:
    """The model directory in the worker container.

    With a model claim (mounted at /models), `model.path` is the directory on that volume: a path
    already under /models is taken as it is (never /models/models/...), any other is relative to
    the volume's root. Without a claim it is a path in the image, as written.
    """
    path = pool.model_path
    if not pool.model_claim:
        return path
    if path == MODEL_MOUNT or path.startswith(MODEL_MOUNT + "/"):
        return path
    return f"{MODEL_MOUNT}/{path.lstrip('/')}".rstrip("/")

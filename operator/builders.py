"""Pure builders: a PoolSpec in, Kubernetes manifest dicts out (no I/O, no kopf).

The handler adopts each manifest (owner reference) and creates it if absent. Labels follow the
`app.kubernetes.io/*` convention plus `lorafleet.dev/pool`, which is also the pod selector.
"""

from __future__ import annotations

import base64
from typing import Any

from lorafleet.operator.retire import GATE
from lorafleet.operator.sources import CACHE_MOUNT, cache_volume, worker_env
from lorafleet.operator.spec import (
    GPU_RESOURCE,
    MODEL_MOUNT,
    POOL_LABEL,
    SHM_MOUNT,
    TOKEN_MOUNT,
    PoolSpec,
    model_dir,
)
from lorafleet.operator.vllm_pods import vllm_pod_template, vllm_service_ports

TOKEN_KEY = "token"
# The worker image's user (docker/worker.Dockerfile). The token Secret's files are group-readable
# and owned by fsGroup, so that user reads them; nobody else in the pod runs.
WORKER_UID = 10001
TOKEN_MODE = 0o440


def labels(pool: PoolSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "lorafleet-worker",
        "app.kubernetes.io/instance": pool.name,
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/managed-by": "lorafleet-operator",
        POOL_LABEL: pool.name,
    }


def _meta(pool: PoolSpec, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace, "labels": labels(pool)}


def worker_args(pool: PoolSpec) -> list[str]:
    """`lorafleet worker` flags (issue 4's CLI); adapters are loaded later by the operator."""
    engine = pool.engine
    return [
        "worker",
        "--model", model_dir(pool),
        "--served-model-name", pool.served_name,
        "--host", "0.0.0.0",
        "--port", str(pool.http_port),
        "--admin-port", str(pool.admin_port),
        "--max-loras", str(engine.max_loras),
        "--max-cpu-loras", str(engine.max_cpu_loras),
        "--max-lora-rank", str(engine.max_lora_rank),
        "--max-loras-per-request", str(engine.max_loras_per_request),
        "--admin-token-file", f"{TOKEN_MOUNT}/{TOKEN_KEY}",
        "--adapter-root", pool.adapter_mount,
        "--device", engine.device,
        "--dtype", engine.dtype,
    ] + (["--enable-auto-tool-choice", "--tool-call-parser", engine.tool_call_parser] if engine.tool_call_parser else []) + (
        ["--reasoning-parser", engine.reasoning_parser] if engine.reasoning_parser else []) + (
        ["--tensor-parallel-size", str(pool.tensor_parallel_size)] if pool.tensor_parallel_size > 1 else [])


def pod_template(pool: PoolSpec) -> dict[str, Any]:
    if pool.server.kind == "vllm":
        return with_pod_fields(with_tensor_parallel(vllm_pod_template(pool, labels(pool)), pool), pool)
    volumes: list[dict[str, Any]] = [
        {"name": "admin-token", "secret": {"secretName": pool.token_secret, "defaultMode": TOKEN_MODE}},
        {
            "name": "adapters",
            "persistentVolumeClaim": {"claimName": pool.adapter_claim, "readOnly": True}
            if pool.adapter_claim
            else None,
            "emptyDir": None if pool.adapter_claim else {},
        },
    ]
    volumes[1] = {k: v for k, v in volumes[1].items() if v is not None}
    mounts = [
        {"name": "admin-token", "mountPath": TOKEN_MOUNT, "readOnly": True},
        {"name": "adapters", "mountPath": pool.adapter_mount, "readOnly": True},
    ]
    if pool.model_claim:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pool.model_claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    cache = cache_volume(pool.sources)  # remote sources (spec.sources): the fetch cache
    if cache is not None:
        volumes.append(cache)
        mounts.append({"name": cache["name"], "mountPath": CACHE_MOUNT})
    container: dict[str, Any] = {
        "name": "worker",
        "image": pool.image,
        "imagePullPolicy": pool.image_pull_policy,
        "command": ["lorafleet"],
        "args": worker_args(pool),
        "ports": [
            {"name": "http", "containerPort": pool.http_port, "protocol": "TCP"},
            {"name": "admin", "containerPort": pool.admin_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 120},
        "volumeMounts": mounts,
    }
    env = worker_env(pool.sources)  # the cache's settings and the pool's Secret, by reference only
    if env:
        container["env"] = env
    if pool.resources:
        container["resources"] = {k: dict(v) for k, v in pool.resources.items()}
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # In-flight requests finish before the pod goes; the operator drains adapters meanwhile.
        "terminationGracePeriodSeconds": 60,
        "automountServiceAccountToken": False,
    }
    return with_pod_fields(with_tensor_parallel({"metadata": {"labels": labels(pool)}, "spec": spec}, pool), pool)


def with_tensor_parallel(template: dict[str, Any], pool: PoolSpec) -> dict[str, Any]:
    """spec.tensorParallelSize > 1: one GPU per rank (on CUDA) and a memory-backed /dev/shm, which
    NCCL's shared-memory transport needs beyond the container runtime's 64 MiB default."""
    if pool.tensor_parallel_size == 1:
        return template
    spec = template["spec"]
    c = spec["containers"][0]
    if pool.engine.device == "cuda" or pool.server.kind == "vllm":
        resources = c.setdefault("resources", {})
        resources["limits"] = {**resources.get("limits", {}), GPU_RESOURCE: pool.tensor_parallel_size}
    spec["volumes"] = spec.get("volumes", []) + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    c["volumeMounts"] = c.get("volumeMounts", []) + [{"name": "dshm", "mountPath": SHM_MOUNT}]
    return template


def with_pod_fields(template: dict[str, Any], pool: PoolSpec) -> dict[str, Any]:
    """A worker pod template (ours or a vLLM one) with Pod Security `restricted` and the pool's
    pod fields: scheduling, pull secrets, extra env, volumes and mounts."""
    pod = pool.pod
    spec = template["spec"]
    for c in spec["containers"]:
        c["securityContext"] = {**c.get("securityContext", {}), "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": False, "runAsNonRoot": True,
                                "capabilities": {"drop": ["ALL"]}}
        c["volumeMounts"] = c.get("volumeMounts", []) + [dict(m) for m in pod.volume_mounts]
        if pod.env:  # the pool's own entries win over the operator's of the same name (e.g. AWS_REGION)
            names = {e["name"] for e in pod.env}
            c["env"] = [e for e in c.get("env", []) if e["name"] not in names] + [dict(e) for e in pod.env]
    spec["volumes"] = spec.get("volumes", []) + [dict(v) for v in pod.volumes]
    # Ready (for the Deployment's rollout, the Service, the routers) only once the operator says the
    # pod holds its adapters and no pod leaving holds an adapter's last copy (operator/retire.py).
    spec["readinessGates"] = [{"conditionType": GATE}]
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": WORKER_UID,
        "runAsGroup": WORKER_UID,
        "fsGroup": WORKER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    optional = {
        "nodeSelector": dict(pod.node_selector) if pod.node_selector else None,
        "tolerations": [dict(t) for t in pod.tolerations] or None,
        "affinity": dict(pod.affinity) if pod.affinity else None,
        "priorityClassName": pod.priority_class,
        "runtimeClassName": pod.runtime_class,
        "imagePullSecrets": [{"name": n} for n in pod.image_pull_secrets] or None,
        # IRSA / EKS Pod Identity / GKE Workload Identity: the ServiceAccount's annotations name the
        # cloud role; those webhooks project their own token, so the API token stays unmounted.
        "serviceAccountName": pool.service_account,
    }
    spec |= {k: v for k, v in optional.items() if v is not None}
    return template


def workload(pool: PoolSpec) -> dict[str, Any]:
    """Deployment (default) or StatefulSet of the pool's workers."""
    spec: dict[str, Any] = {
        "replicas": pool.replicas,
        "selector": {"matchLabels": pool.selector},
        "template": pod_template(pool),
    }
    if pool.workload_kind == "StatefulSet":
        spec["serviceName"] = pool.name
        spec["podManagementPolicy"] = "Parallel"
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(pool, pool.name), "spec": spec}
    spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(pool, pool.name), "spec": spec}


def service(pool: PoolSpec) -> dict[str, Any]:
    """Headless: the router and the operator address each worker, never a load-balanced VIP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, pool.name),
        "spec": {
            "clusterIP": "None",
            "selector": pool.selector,
            "publishNotReadyAddresses": False,
            "ports": vllm_service_ports(pool) if pool.server.kind == "vllm" else [
                {"name": "http", "port": pool.http_port, "targetPort": "http"},
                {"name": "admin", "port": pool.admin_port, "targetPort": "admin"},
            ],
        },
    }


def token_secret(pool: PoolSpec, token: str) -> dict[str, Any]:
    """The admin-token Secret; `token` is generated once by the handler and kept across reconciles."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(pool, pool.token_secret),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def pod_disruption_budget(pool: PoolSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(pool, pool.name),
        "spec": {"maxUnavailable": pool.max_unavailable, "selector": {"matchLabels": pool.selector}},
    }


def pool_children(pool: PoolSpec, token: str) -> list[dict[str, Any]]:
    return [token_secret(pool, token), workload(pool), service(pool), pod_disruption_budget(pool)]


def read_token(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"][TOKEN_KEY]).decode()

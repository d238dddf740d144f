"""Pure builders for the pods of a LoraPool whose `spec.server.kind` is `vllm`: a stock vLLM OpenAI
server with LoRA on and runtime adapter updates allowed, placed and loaded by the operator through
the same placement code as our workers (vLLM's `/v1/load_lora_adapter` has our worker's shape).

- The pool's admin token is vLLM's API key (`VLLM_API_KEY` from the pool's Secret, never in the pod
  spec in plain text); it guards every `/v1/*` call, so the router presents it on generation too.
- `spec.engine` becomes vLLM's flags of the same names (`--max-loras`, `--max-cpu-loras`,
  `--max-lora-rank`, `--dtype`); `spec.server.args` and `spec.server.env` come after the operator's.
- One port: generation and the LoRA endpoints are on `spec.ports.http`.
- The pod is labelled `lorafleet.dev/worker-kind: vllm`, so the router's Kubernetes discovery reads it
  as a vLLM replica (and its LoRA limits from these flags).
"""

from __future__ import annotations

from typing import Any

from lorafleet.operator.spec import MODEL_MOUNT, PoolSpec, model_dir

KIND_LABEL = "lorafleet.dev/worker-kind"  # router/discovery.py KIND_LABEL (the operator does not import the router)
TOKEN_KEY = "token"  # builders.TOKEN_KEY: the pool Secret's key
ENTRYPOINT = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def vllm_args(pool: PoolSpec) -> list[str]:
    engine = pool.engine
    model = model_dir(pool)
    args = [
        "--model", model,
        "--served-model-name", pool.served_name,
        "--host", "0.0.0.0",
        "--port", str(pool.http_port),
        "--enable-lora",
        "--max-loras", str(engine.max_loras),
        "--max-cpu-loras", str(engine.max_cpu_loras),
        "--max-lora-rank", str(engine.max_lora_rank),
    ]
    if engine.dtype != "auto":
        args += ["--dtype", engine.dtype]
    if pool.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(pool.tensor_parallel_size)]
    return args + list(pool.server.args)


def vllm_env(pool: PoolSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"},
        {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": pool.token_secret, "key": TOKEN_KEY}}},
    ]
    return env + [{"name": n, "value": v} for n, v in pool.server.env]


def vllm_pod_template(pool: PoolSpec, labels: dict[str, str]) -> dict[str, Any]:
    """The pod template of a vLLM pool (`labels`: the pool's, from builders.labels)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if pool.adapter_claim:
        volumes.append({"name": "adapters", "persistentVolumeClaim": {"claimName": pool.adapter_claim, "readOnly": True}})
        mounts.append({"name": "adapters", "mountPath": pool.adapter_mount, "readOnly": True})
    if pool.model_claim:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pool.model_claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    container: dict[str, Any] = {
        "name": "vllm",
        "image": pool.server.image or pool.image,
        "imagePullPolicy": pool.image_pull_policy,
        "command": list(ENTRYPOINT),
        "args": vllm_args(pool),
        "env": vllm_env(pool),
        "ports": [{"name": "http", "containerPort": pool.http_port, "protocol": "TCP"}],
        # vLLM's /health is open (its API key guards /v1/* only) and answers once the engine is up
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 180},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if pool.resources:
        container["resources"] = {k: dict(v) for k, v in pool.resources.items()}
    return {
        "metadata": {"labels": {**labels, KIND_LABEL: "vllm"}},
        "spec": {
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds": 60,
            "automountServiceAccountToken": False,
        },
    }


def vllm_service_ports(pool: PoolSpec) -> list[dict[str, Any]]:
    return [{"name": "http", "port": pool.http_port, "targetPort": "http"}]

"""`spec.server` of a LoraPool: which server its pods run (ours, or a stock vLLM OpenAI server).

    server:
      kind: vllm                       # lorafleet (default, the field absent) | vllm
      image: vllm/vllm-openai:v0.32.0  # vLLM's image (default: spec.image)
      args: ["--gpu-memory-utilization", "0.85"]   # more vLLM flags, after the operator's own
      env: [{name: VLLM_CPU_KVCACHE_SPACE, value: "4"}]

`spec.engine` keeps its meaning (max_loras, max_cpu_loras, max_lora_rank, dtype) for both kinds; the
vLLM pod gets them as vLLM's flags of the same names (operator/vllm_pods.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVER_KINDS = ("lorafleet", "vllm")
# What the operator sets itself on a vLLM pod: `args` and `env` may not name them.
RESERVED_ARGS = ("--model", "--served-model-name", "--host", "--port", "--api-key", "--enable-lora",
                 "--max-loras", "--max-cpu-loras", "--max-lora-rank")
RESERVED_ENV = ("VLLM_API_KEY", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True, slots=True)
class ServerSpec:
    kind: str = "lorafleet"
    image: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


class InvalidServer(ValueError):
    """spec.server as written cannot be run (spec.py turns it into a SpecError, InvalidSpec)."""


def parse_server(spec: Mapping[str, Any]) -> ServerSpec:
    """`spec.server`, absent for our own worker; raises InvalidServer naming the field."""
    raw = spec.get("server")
    if raw is None:
        return ServerSpec()
    if not isinstance(raw, Mapping):
        raise InvalidServer(f"spec.server must be an object, not {type(raw).__name__}")
    kind = raw.get("kind", "lorafleet")
    if kind not in SERVER_KINDS:
        raise InvalidServer(f"spec.server.kind must be one of {', '.join(SERVER_KINDS)}, not {kind!r}")
    image = raw.get("image")
    if image is not None and (not isinstance(image, str) or not image):
        raise InvalidServer(f"spec.server.image must be a non-empty string, not {image!r}")
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidServer("spec.server.args must be a list of strings")
    taken = sorted({a.partition("=")[0] for a in args} & set(RESERVED_ARGS))
    if taken:
        raise InvalidServer(f"spec.server.args may not set {', '.join(taken)}: the operator sets them "
                                       "(from spec.model, spec.ports and spec.engine)")
    env = raw.get("env") or []
    pairs = []
    for i, item in enumerate(env if isinstance(env, list) else [None]):
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"] \
                or not isinstance(item.get("value", ""), str):
            raise InvalidServer(f"spec.server.env[{i}] must be {{name: string, value: string}}")
        if item["name"] in RESERVED_ENV:
            raise InvalidServer(f"spec.server.env may not set {item['name']}: the operator sets it")
        pairs.append((item["name"], item.get("value", "")))
    if kind == "lorafleet" and (image or args or pairs):
        raise InvalidServer("spec.server.image, args and env are for kind vllm "
                                       "(our worker's settings are spec.image and spec.engine)")
    return ServerSpec(kind, image, tuple(args), tuple(pairs))

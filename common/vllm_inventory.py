"""A stock vLLM server's state as an `AdapterInventory`, from what vLLM exposes (pure, torch-free).

vLLM has no `/v1/adapters`; the router and the operator read a vLLM replica through this module:

- `GET /v1/models`: the base model (no `parent`) and every adapter registered with the server
  (`--lora-modules`, `POST /v1/load_lora_adapter`), each with `parent` set to the base model;
- `GET /metrics`: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (`vllm:gpu_cache_usage_perc` before 0.8), `vllm:lora_requests_info{max_lora, running_lora_adapters,
  waiting_lora_adapters}` (one series per label set ever seen, valued by the unix time it was last
  current: the newest is the state), and where the server has them (vLLM PR #54830)
  `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}` and `vllm:max_gpu_lora_adapters`.

Tiers: an adapter vLLM reports loaded at level gpu/cpu has that tier; one with requests running
is on the GPU; any other registered adapter is "cpu" for routing: a request for it needs no load
call (vLLM reads it from disk itself if its CPU cache dropped it). vLLM reports neither its CPU cache
size nor its maximum rank: they come from the replica's settings (`VllmLimits`), vLLM's defaults
otherwise. One adapter per request: vLLM does not compose adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.protocol import AdapterInfo, AdapterInventory

# vLLM's defaults for what its metrics do not say (`--max-loras`, `--max-lora-rank`).
VLLM_DEFAULT_MAX_LORAS = 1
VLLM_DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True, slots=True)
class VllmLimits:
    """What the replica was started with, where vLLM does not report it (None: vLLM's default;
    max_cpu_loras defaults to max_loras, as in vLLM)."""

    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int | None = None


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    level: str  # "gpu" | "cpu"
    pinned: bool = False
    rank: int = 0


@dataclass(slots=True)
class VllmMetrics:
    """The parts of a vLLM `/metrics` page the router routes on."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    max_lora: int | None = None
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    loaded: dict[str, LoadedAdapter] | None = None  # None: the server has no vllm:lora_adapter_loaded
    max_gpu_adapters: int | None = None


def _names(value: str) -> tuple[str, ...]:
    return tuple(n for n in value.split(",") if n)


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Raises ValueError for a page that is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = VllmMetrics()
    newest = -1.0
    kv_new: float | None = None
    kv_old: float | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:num_requests_running":
                out.running += int(s.value)
            elif s.name == "vllm:num_requests_waiting":
                out.waiting += int(s.value)
            elif s.name == "vllm:kv_cache_usage_perc":
                kv_new = max(kv_new or 0.0, s.value)
            elif s.name == "vllm:gpu_cache_usage_perc":
                kv_old = max(kv_old or 0.0, s.value)
            elif s.name == "vllm:lora_requests_info" and s.value >= newest:
                newest = s.value
                max_lora = s.labels.get("max_lora", "")
                out.max_lora = int(max_lora) if max_lora.isdigit() else out.max_lora
                out.running_adapters = _names(s.labels.get("running_lora_adapters", ""))
                out.waiting_adapters = _names(s.labels.get("waiting_lora_adapters", ""))
            elif s.name == "vllm:lora_adapter_loaded":
                if out.loaded is None:
                    out.loaded = {}
                name, level = s.labels.get("adapter_name"), s.labels.get("level")
                if name and level in ("gpu", "cpu") and s.value > 0:
                    rank = s.labels.get("rank", "")
                    seen = out.loaded.get(name)
                    if seen is None or level == "gpu":  # an adapter in a GPU slot is also in the CPU cache
                        out.loaded[name] = LoadedAdapter(level, s.labels.get("pinned") == "true",
                                                         int(rank) if rank.isdigit() else 0)
            elif s.name == "vllm:max_gpu_lora_adapters":
                out.max_gpu_adapters = int(s.value)
        if family.name == "vllm:lora_adapter_loaded" and out.loaded is None:
            out.loaded = {}  # the metric is there with no adapter loaded
    kv = kv_new if kv_new is not None else kv_old
    out.kv_cache_usage = min(1.0, max(0.0, kv or 0.0))
    return out


def registered_adapters(models: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """(base model id, {adapter: path}) from a `/v1/models` answer; raises ValueError when it has no
    base model (not a vLLM model list)."""
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models: no `data` list")
    bases = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and not m.get("parent")]
    if not bases:
        raise ValueError("/v1/models lists no base model")
    adapters = {m["id"]: str(m.get("root") or "") for m in data
                if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")}
    return bases[0], adapters


@dataclass(slots=True)
class _Adapter:
    tier: str = "cpu"
    rank: int = 0
    pinned: bool = False
    in_flight: int = 0


def vllm_inventory(models: Mapping[str, Any], metrics: VllmMetrics | None,
                   limits: VllmLimits = VllmLimits()) -> AdapterInventory:
    """The inventory the router and operator read, from `/v1/models` and (if it answered) `/metrics`."""
    base, registered = registered_adapters(models)
    m = metrics or VllmMetrics()
    max_loras = m.max_gpu_adapters or m.max_lora or limits.max_loras or VLLM_DEFAULT_MAX_LORAS
    adapters = {name: _Adapter() for name in registered}
    busy = set(m.running_adapters)
    for name, entry in adapters.items():
        loaded = (m.loaded or {}).get(name)
        if loaded is not None:
            entry.tier, entry.rank, entry.pinned = loaded.level, loaded.rank, loaded.pinned
        if name in busy:
            entry.tier = "gpu"  # a running request holds a GPU slot
            entry.in_flight = 1  # vLLM counts none per adapter: at least one
    return AdapterInventory(
        model=base,
        max_loras=max_loras,
        max_cpu_loras=max(limits.max_cpu_loras or max_loras, max_loras),
        max_lora_rank=limits.max_lora_rank or VLLM_DEFAULT_MAX_LORA_RANK,
        max_loras_per_request=1,
        num_requests_running=m.running,
        num_requests_waiting=m.waiting,
        kv_cache_usage=m.kv_cache_usage,
        adapters=[
            AdapterInfo(name=name, tier=e.tier, rank=e.rank, alpha=0.0, digest="", path=registered[name],
                        requests_in_flight=e.in_flight, pinned=e.pinned)
            for name, e in sorted(adapters.items())
        ],
    )

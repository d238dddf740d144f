"""Scorers: each maps (request, replica) to [0, 1]; a policy weights and sums them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.router.scheduling.hashing import weight
from lorafleet.router.scheduling.types import EndpointView, FleetStats, RequestInfo

_U64 = float(2**64)


@dataclass(frozen=True, slots=True)
class Residency:
    """Where the request's adapters already live: GPU slot > CPU cache > nowhere.

    A composed request scores its worst-placed adapter: it waits for that one.
    """

    gpu: float = 1.0
    cpu: float = 0.7
    name: str = "residency"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        if not req.adapters:
            return 1.0
        score = 1.0
        for adapter in req.adapters:
            tier = endpoint.tier(adapter)
            score = min(score, self.gpu if tier == "gpu" else self.cpu if tier == "cpu" else 0.0)
        return score


@dataclass(frozen=True, slots=True)
class Load:
    """Spare capacity: 1 when idle, 0 at or past `capacity` concurrent requests (least-request)."""

    name: str = "load"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        return max(0.0, 1.0 - endpoint.load / max(1, endpoint.capacity))


@dataclass(frozen=True, slots=True)
class LoraAffinity:
    """The Gateway API Inference Extension's LoRA-affinity scorer, as published (our baseline).

    1.0 if the adapter has requests running there, 0.8 if the replica has a free adapter slot,
    0.6 if the adapter is only waiting there, else 0. Its signal is in-flight requests, not what
    is loaded: an idle but loaded adapter looks absent.
    """

    name: str = "lora-affinity"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        if not req.adapters:
            return 1.0
        adapter = req.adapters[0]  # GIE routes on one adapter per request
        if adapter in endpoint.active:
            return 1.0
        if len(endpoint.active) < endpoint.max_loras:
            return 0.8
        if adapter in endpoint.waiting_adapters:
            return 0.6
        return 0.0


@dataclass(frozen=True, slots=True)
class HashAffinity:
    """Rendezvous weight of (request key, replica) scaled to [0, 1).

    Maximising it picks the key's first replica in rendezvous order among those left, which is how
    consistent hashing concentrates each adapter on few replicas and moves little on churn.
    """

    name: str = "hash-affinity"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        return weight(req.key, endpoint.name) / _U64


@dataclass(frozen=True, slots=True)
class SlotFree:
    """1 if the request's adapters can join the replica's next batch without waiting for a GPU slot.

    vLLM runs at most max_loras distinct adapters per batch; a request whose adapter is not running
    on a replica whose slots are all taken by running adapters is deferred — for as long as those
    adapters keep requests in flight, which for popular ones is indefinitely.
    """

    name: str = "slot-free"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        new = sum(1 for a in req.adapters if a not in endpoint.active)
        return 1.0 if len(endpoint.active) + new <= endpoint.max_loras else 0.0


@dataclass(frozen=True, slots=True)
class SlotHeadroom:
    """Share of the replica's GPU slots still free once the request's adapters join (1 if they all run).

    Graded where `SlotFree` is binary: among replicas that can all take a cold adapter, the one
    with most free slots is the least likely to make this or a later request queue for a slot.
    Adapters queued for a slot count as taking one.
    """

    name: str = "slot-headroom"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        if all(a in endpoint.active for a in req.adapters):
            return 1.0
        taken = len(endpoint.active | endpoint.waiting_adapters | frozenset(req.adapters))
        return max(0.0, (endpoint.max_loras - taken) / max(1, endpoint.max_loras))


def _never_seen(adapter: str) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class CacheVictim:
    """How little a cold load here would cost the CPU cache: fleet-wide LFU placement of cold adapters.

    1 if the request's adapters are all resident, or if they fit while `scratch_slots` stay free.
    Otherwise the load must evict: f / (f + v), where f is the least popular missing adapter's
    frequency and v the frequency of the most popular idle resident that must go (the `need`
    least popular idle residents, as `FrequencyAdmission` would pick them); 0 if too few are idle.
    Maximising it sends a cold adapter to the replica whose cache loses the least, so admission
    evicts the fleet's least popular adapter instead of one replica's, and a popular newcomer is
    admitted rather than loaded into a scratch slot and dropped.
    """

    frequency: Callable[[str], float] = _never_seen
    scratch_slots: int = 1
    name: str = "cache-victim"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        resident = endpoint.resident
        missing = [a for a in req.adapters if a not in resident]
        if not missing:
            return 1.0
        need = self.scratch_slots + len(missing) - (endpoint.max_cpu_loras - len(resident))
        if need <= 0:
            return 1.0
        busy = endpoint.active | endpoint.waiting_adapters | endpoint.pinned | set(req.adapters)
        idle = sorted(self.frequency(a) for a in resident if a not in busy)
        if len(idle) < need:
            return 0.0
        v = idle[need - 1]
        f = min(self.frequency(a) for a in missing)
        if f + v <= 0:
            return 1.0
        return f / (f + v)


@dataclass(frozen=True, slots=True)
class LoraLoadState:
    """llm-d's `lora-load-state-scorer` (llm-d/llm-d-router PR #2792), on vLLM's residency metric.

    Reads where the adapter is loaded (`vllm:lora_adapter_loaded{level=gpu|cpu}`) instead of where
    it has requests: GPU-resident 1.0, CPU-resident 0.7, a free GPU slot 0.6, a GPU slot held by
    an idle (evictable) adapter 0.3, every slot running something 0.0. A base-model request scores
    the share of GPU slots not serving an adapter right now.
    """

    gpu: float = 1.0
    cpu: float = 0.7
    free_slot: float = 0.6
    evictable: float = 0.3
    name: str = "lora-load-state"

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        slots = max(1, endpoint.max_loras)
        if not req.adapters:
            return max(0.0, 1.0 - len(endpoint.active) / slots)
        adapter = req.adapters[0]  # one adapter per request, as the EPP routes
        if adapter in endpoint.gpu:
            return self.gpu
        if adapter in endpoint.cpu:
            return self.cpu
        if len(endpoint.gpu) < endpoint.max_loras:
            return self.free_slot
        if any(a not in endpoint.active and a not in endpoint.pinned for a in endpoint.gpu):
            return self.evictable
        return 0.0

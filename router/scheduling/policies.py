"""Scheduling policies: a named composition of filters, weighted scorers and a picker.

`schedule(req, endpoints)` is the router's whole placement decision. The gateway calls it per
request; `bench/fleet_sim.py` calls the same objects on simulated replicas. Policies other than
`lorafleet` exist to be compared against in that benchmark (and can be selected with
`lorafleet router --policy`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from lorafleet.router.scheduling.admission import FrequencyAdmission
from lorafleet.router.scheduling.filters import (
    Available,
    BoundedLoad,
    DemandReplicaSet,
    ServesModel,
    SlotQueue,
)
from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.pickers import MaxScore, RoundRobin
from lorafleet.router.scheduling.scorers import (
    CacheVictim,
    HashAffinity,
    Load,
    LoraAffinity,
    LoraLoadState,
    Residency,
    SlotFree,
    SlotHeadroom,
)
from lorafleet.router.scheduling.skeleton import skeleton_order
from lorafleet.router.scheduling.types import (
    AdmissionPlan,
    Decision,
    EndpointView,
    Filter,
    FleetStats,
    NoEndpoint,
    Picker,
    Reason,
    RequestInfo,
    Scorer,
)


@dataclass(slots=True)
class Policy:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[float, Scorer], ...]
    picker: Picker
    admission: FrequencyAdmission | None = None
    frequency: FrequencySketch = field(default_factory=FrequencySketch)
    # Keys with at least this share of recent requests may keep extra copies on several replicas;
    # a copy of a less popular adapter made while its home was too busy is transient (unloaded
    # once idle). None: every copy goes through admission alike.
    replicate_share: float | None = None
    # Where no replica left after the filters holds the request's adapters, only the first
    # `cold_candidates` of them in the key's rendezvous order (`skeleton_order` over all replicas)
    # are scored: a cold adapter loads on one of a few stable homes, and a decision needs no look
    # at every replica (`indexed.IndexedPolicy`). Where some hold them, only those are scored
    # (they outrank any cold load anyway). None: every replica left is scored.
    cold_candidates: int | None = None
    # Where more than `holder_sample` replicas (of all given, in name order) hold the request's
    # adapters, only `holder_sample` of them drawn uniformly from `rng` are scored, among those the
    # filters left: the power of k choices, so a popular adapter's decision looks at k of its
    # copies, not hundreds. If none of the drawn is left, every holder left is scored. None: all.
    holder_sample: int | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # The sketch ages every `aging_per_slot` requests per CPU adapter slot of the replicas given
    # (healthy, not ejected; a decision given fewer, as a retry is, counts those), at least every
    # `aging_floor` (`FrequencySketch.age_with`). None: the sketch's own fixed period.
    aging_per_slot: float | None = None
    aging_floor: int = 50_000

    def schedule(self, req: RequestInfo, endpoints: Sequence[EndpointView]) -> Decision:
        if req.adapters:
            if self.aging_per_slot is not None:
                slots = sum(e.max_cpu_loras for e in endpoints if e.healthy and not e.ejected)
                self.frequency.age_with(slots, self.aging_per_slot, self.aging_floor)
            self.frequency.add(req.key)
            req = replace(req, share=self.frequency.share(req.key))
        stats = FleetStats.of(endpoints, req.model)
        candidates = list(endpoints)
        for f in self.filters:
            candidates = f(req, candidates, stats)
            if not candidates:
                raise NoEndpoint(f"no replica left after filter {f.name!r}")
        if self.cold_candidates is not None and req.adapters:
            candidates = self._narrow(req, candidates, endpoints)
        scored = [(e, self._score(req, e, stats)) for e in candidates]
        chosen = self.picker(req, scored)
        missing = tuple(a for a in req.adapters if a not in chosen.resident)
        plan = AdmissionPlan()
        if missing and self.admission is not None:
            spill = self._is_spill(req, missing, chosen, endpoints)
            plan = self.admission.plan(req.adapters, chosen, self.frequency.estimate, transient=spill)
        return Decision(chosen, reason_for(req, chosen), missing, plan)

    def _narrow(
        self, req: RequestInfo, candidates: list[EndpointView], endpoints: Sequence[EndpointView]
    ) -> list[EndpointView]:
        holders = [e for e in candidates if all(a in e.resident for a in req.adapters)]
        k = self.holder_sample
        if k is not None:
            everyone = sorted(e.name for e in endpoints if all(a in e.resident for a in req.adapters))
            if len(everyone) > k:
                drawn = {everyone[j] for j in draw(self.rng, len(everyone), k)}
                holders = [e for e in holders if e.name in drawn] or holders
        if holders:
            return holders
        rank = {name: i for i, name in enumerate(skeleton_order(req.key, [e.name for e in endpoints]))}
        return sorted(candidates, key=lambda e: rank[e.name])[: self.cold_candidates]

    def _is_spill(
        self,
        req: RequestInfo,
        missing: tuple[str, ...],
        chosen: EndpointView,
        endpoints: Sequence[EndpointView],
    ) -> bool:
        """A load of a not-hot adapter that a serving replica other than `chosen` already holds."""
        if self.replicate_share is None or req.share >= self.replicate_share:
            return False
        return any(
            a in e.resident
            for e in endpoints
            if e.name != chosen.name and e.healthy and not e.ejected and e.model == req.model
            for a in missing
        )

    def _score(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        return sum(w * min(1.0, max(0.0, scorer(req, endpoint, stats))) for w, scorer in self.scorers)


def draw(rng: random.Random, n: int, k: int) -> set[int]:
    """`k` distinct positions of `n` (k < n), uniformly: draws until k are distinct (no list of n).
    u × n < n for every u < 1 that `random()` returns, so a position is always in range."""
    uniform = rng.random
    picked: set[int] = set()
    while len(picked) < k:
        picked.add(int(uniform() * n))
    return picked


def reason_for(req: RequestInfo, endpoint: EndpointView) -> Reason:
    if not req.adapters:
        return "base"
    tiers = [endpoint.tier(a) for a in req.adapters]
    if any(t is None for t in tiers):
        return "cold"
    return "hot" if all(t == "gpu" for t in tiers) else "warm"


def lorafleet_policy(
    load_factor: float = 1.25,
    cold_load_factor: float = 2.0,
    hot_share: float = 0.04,
    scratch_slots: int = 0,
    max_slots_over: int = 3,
    spill_full_share: float | None = 0.5,
    victim_weight: float = 0.2,
    admission_margin: float = 1.5,
    cold_candidates: int | None = 8,
    holder_sample: int | None = 8,
    aging_per_slot: float | None = 100.0,
) -> Policy:
    """Ours: residency first, within a load bound and a GPU-slot queue bound.

    Filters: only hot adapters (≥ `hot_share` of recent requests) are held to `load_factor` and
    spill to more replicas; the rest may load a replica up to `cold_load_factor` × the mean so they
    stay where they are resident. A replica where the request would wait for a GPU slot behind
    more than `max_slots_over` adapters is dropped while another can take it (`SlotQueue`): past
    that, a cold load elsewhere is the faster path, and such a spill copy is transient. While at
    least `spill_full_share` of the replicas have every GPU slot taken or asked for, the fleet is
    slot-bound and nothing spills: a copy would take a free slot that first loads need.

    Weights make the order lexicographic in residency: CPU beats a cold load (0.7 > 0.6495), GPU
    beats CPU where the GPU copy can join the batch (0.3 > 0.1 + 0.049 + 0.0005; `CacheVictim`
    is 1 for both). Within a tier: a replica where the adapters join the next batch without waiting
    for a slot (0.3), then, for a cold adapter, the replica whose CPU cache loses the least
    popular adapter to the load (`victim_weight`: fleet-wide LFU instead of per replica), then the
    most free slots (≤ 0.1: a cold adapter goes where it adds least slot pressure), then spare capacity
    (≤ 0.049), then the rendezvous order (≤ 0.0005, below one request of load: ties only, so an
    idle fleet still places a key on its rendezvous home). Cache admission keeps rare adapters
    from evicting popular ones; a newcomer must be `admission_margin` × as popular as its victim
    (noisy counts of similar adapters otherwise swap places), and no scratch slot is reserved
    (`scratch_slots`=0): a load that is not admitted evicts the least popular idle resident.
    A cold adapter is placed on one of its first `cold_candidates` rendezvous replicas among those
    the filters left (all of them on a fleet that small), and an adapter held by more than
    `holder_sample` replicas is scored on that many of its holders drawn at random (power of k
    choices), so scoring looks at few replicas. The popularity sketch ages every `aging_per_slot`
    requests per CPU adapter slot of the fleet, at least every 50,000 (`FrequencySketch.age_with`):
    the same memory in time at any fleet size (50,000 was set at 8 replicas × 64 slots), so the
    counts admission compares near the cache's capacity do not thin out as the fleet grows.
    """
    frequency = FrequencySketch()
    return Policy(
        "lorafleet",
        (
            Available(),
            ServesModel(),
            BoundedLoad(load_factor, cold_load_factor, hot_share),
            SlotQueue(max_slots_over, spill_full_share),
        ),
        (
            (1.0, Residency()),
            (0.3, SlotFree()),
            (victim_weight, CacheVictim(frequency.estimate, scratch_slots)),
            (0.1, SlotHeadroom()),
            (0.049, Load()),
            (0.0005, HashAffinity()),
        ),
        MaxScore(),
        admission=FrequencyAdmission(scratch_slots=scratch_slots, margin=admission_margin),
        frequency=frequency,
        replicate_share=hot_share,
        cold_candidates=cold_candidates,
        holder_sample=holder_sample,
        aging_per_slot=aging_per_slot,
        aging_floor=frequency.halve_every,
    )


def round_robin_policy() -> Policy:
    return Policy("round-robin", (Available(), ServesModel()), (), RoundRobin())


def least_request_policy() -> Policy:
    return Policy("least-request", (Available(), ServesModel()), ((1.0, Load()),), MaxScore())


def gie_policy() -> Policy:
    """Gateway API Inference Extension: LoRA affinity (1.0/0.8/0.6/0), then least queue."""
    return Policy(
        "gie-lora-affinity", (Available(), ServesModel()), ((1.0, LoraAffinity()), (0.1, Load())), MaxScore()
    )


def chwbl_policy(load_factor: float = 1.25) -> Policy:
    """KubeAI's consistent hashing with bounded load over the adapter key."""
    return Policy(
        "chwbl", (Available(), ServesModel(), BoundedLoad(load_factor)), ((1.0, HashAffinity()),), MaxScore()
    )


def dynamo_policy() -> Policy:
    """NVIDIA Dynamo: demand-proportional rendezvous replica sets (`DemandReplicaSet`), least load
    within the set (Dynamo's KV router weighs prefix overlap and load there; the simulated
    requests share no prefixes, so load decides)."""
    return Policy(
        "dynamo-lora-hrw",
        (Available(), ServesModel(), DemandReplicaSet()),
        ((1.0, Load()), (0.0005, HashAffinity())),
        MaxScore(),
    )


def llmd_policy() -> Policy:
    """llm-d's LoRA residency scorer (`LoraLoadState`) with a load term weighted as GIE's."""
    return Policy(
        "llm-d-lora-load-state",
        (Available(), ServesModel()),
        ((1.0, LoraLoadState()), (0.1, Load())),
        MaxScore(),
    )


POLICIES: dict[str, Callable[[], Policy]] = {
    "lorafleet": lorafleet_policy,
    "round-robin": round_robin_policy,
    "least-request": least_request_policy,
    "gie-lora-affinity": gie_policy,
    "chwbl": chwbl_policy,
    "dynamo-lora-hrw": dynamo_policy,
    "llm-d-lora-load-state": llmd_policy,
}

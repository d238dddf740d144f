"""What one pool's reconciler keeps, and pure read-outs of it: no kopf, no HTTP, no clock.

The records (settings, the pods it observed, each adapter's spec and last status, a round's result)
and what they say: failures that only a load reveals (digest, rank as the worker reports them),
ready replicas, the digest to report, and the statuses the adapters and the pool should show now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator import placement
from lorafleet.operator.sources import is_remote
from lorafleet.operator.spec import AdapterSpec, PoolSpec, digest_matches, same_digest
from lorafleet.operator.status import AdapterObservation, adapter_status, pool_phase, status_changed
from lorafleet.operator.worker_client import RESIDENT_TIERS
from lorafleet.protocol import AdapterInfo, AdapterInventory


@dataclass(frozen=True, slots=True)
class ReconcilerSettings:
    resync_s: float = 10.0  # level-triggered repair period (also the kopf timer's interval)
    retry_s: float = 2.0  # after a transient error
    max_rounds_per_wake: int = 6  # make-before-break needs a few rounds (load, verify, unload)
    worker_concurrency: int = 32  # calls in flight per worker
    status_concurrency: int = 32  # status writes in flight
    demand_window_s: float = 300.0
    publish_ttl_s: float = 45.0
    # A copy beyond the placement's pods (a router's, or one demand no longer asks for) stays while
    # it served a request this recently (placement rule 6): no unload/reload flapping with routers.
    idle_unload_s: float = 60.0
    # An old version's in-place reload waits this long for a moment without requests on it; then
    # the copy is drained instead (unloaded: new requests go elsewhere, those running finish with the
    # old weights) and the new version loaded once they have, so a busy adapter still gets updated.
    reload_grace_s: float = 30.0


@dataclass(slots=True)
class PodState:
    name: str
    ip: str | None
    ready: bool  # the worker is up (its containers are ready): it may take loads
    draining: bool
    # Kubernetes' Ready, readiness gates included: the Service and the routers send it traffic.
    # None: the same as `ready` (workers outside Kubernetes).
    serving: bool | None = None
    gated: bool = False  # has the operator's readiness gate (`retire.GATE`)
    gate_open: bool = False  # ... and the operator has set it
    revision: str = ""  # the pod template it was made from (pod-template-hash)
    cost: int | None = None  # its pod-deletion-cost annotation
    created: str = ""  # creationTimestamp
    uid: str = ""  # a pod re-created under its name (a StatefulSet's) has another

    @property
    def usable(self) -> bool:
        """Takes new loads: addressable, ready and not going away."""
        return bool(self.ip) and self.ready and not self.draining

    @property
    def in_service(self) -> bool:
        """Routers may send it requests: addressable, Ready and not going away."""
        return bool(self.ip) and (self.ready if self.serving is None else self.serving) and not self.draining


# `url_of(pod, port) -> base URL` of one worker API; `port` is the pool's admin or http port.
UrlOf = Callable[[PodState, int], str]


def pod_url(pod: PodState, port: int) -> str:
    """The default `url_of`: in a cluster every pod serves the pool's ports on its own pod IP."""
    return f"http://{pod.ip}:{port}"


@dataclass(slots=True)
class AdapterRecord:
    spec: AdapterSpec
    generation: int | None
    status: dict[str, Any] | None  # last status known to be on the object
    failure: tuple[str, str] | None = None  # permanent, cleared when the spec changes
    # Another namespace's LoraAdapter serves this name (names are global to the router); set and
    # cleared by the fleet as adapters of that name come and go.
    conflict: tuple[str, str] | None = None
    # pod -> the digest its copy had right after this operator loaded the record's target there
    # (`target_path`); dropped when a poll shows that copy gone or changed (`sync_verified`).
    verified: dict[str, str] = field(default_factory=dict)
    # The source changed since copies were loaded: until a digest says which copies are current,
    # every copy not in `verified` is an old version.
    outdated: bool = False
    # pod -> when an in-place reload there was first refused because requests ran on the old version.
    busy_since: dict[str, float] = field(default_factory=dict)
    # A worker refused this spec's content (reason, message), or it does not have the spec's
    # sha256, while another version served: that version keeps serving (a failed rollout leaves
    # the old version up, as a Deployment's does) and is the target (`serving_path`,
    # `serving_digest`) until a probe of the spec's content succeeds (`next_probe`) or the spec
    # changes.
    update_refused: tuple[str, str] | None = None
    serving_path: str | None = None
    serving_digest: str | None = None
    next_probe: float = 0.0  # clock time of the next try of the spec's content while refused
    probe_delay: float = 0.0
    # The digest a worker reported for this spec's content after this operator loaded it: any copy
    # with another digest (a router's load from an older catalog, a pod that missed the rollout, a
    # disk-tier entry) is an old version. The spec's sha256, when it has one, says it up front.
    current_digest: str | None = None
    # The content the record this one replaced served (its target digest): the version to keep
    # serving if this spec's is refused.
    previous_digest: str | None = None
    # (reason, message) of the last load refused on a new replica while copies of the target serve
    # elsewhere (a remote object changed since its digest was recorded); cleared by a load that takes.
    replica_refused: tuple[str, str] | None = None
    # (worker reason, safe message) of the last load whose remote fetch failed transiently (the
    # store unreachable, a wrong endpoint): retried each round, shown until a load takes.
    fetch_retrying: tuple[str, str] | None = None

    @property
    def expected_digest(self) -> str | None:
        return f"sha256:{self.spec.sha256}" if self.spec.sha256 else self.current_digest

    @property
    def target_digest(self) -> str | None:
        """The content every copy should have: the serving version while an update is refused."""
        return self.serving_digest if self.update_refused else self.expected_digest

    def refuse_update(self, reason: str, message: str, path: str, digest: str | None, now: float) -> None:
        self.update_refused, self.serving_path, self.serving_digest = (reason, message), path, digest
        self.probe_delay = 30.0
        self.next_probe = now + self.probe_delay

    def accept_update(self) -> None:
        self.update_refused = self.serving_path = self.serving_digest = None
        self.verified.clear()  # they held the serving version, no longer the target

    @property
    def problem(self) -> tuple[str, str] | None:
        """Why the adapter is Failed and served nowhere, if it is."""
        return self.failure or self.conflict

    def succeed(self, old: AdapterRecord | None) -> None:
        """Carry over what still holds from the record this one replaces (a spec change, or the
        same spec again); without one, `status.source` tells what the loaded copies came from."""
        if old is None:
            shown = (self.status or {}).get("source")
            self.outdated = shown is not None and shown != self.spec.source  # changed while no operator ran
            self.previous_digest = (self.status or {}).get("digest")  # what the copies held, as last reported
            if self.spec.sha256 is None and is_remote(self.spec.source) and shown == self.spec.source:
                self.current_digest = self.previous_digest  # the recorded pin outlives the operator
            return
        self.conflict = old.conflict
        if old.spec == self.spec:
            self.failure = old.failure
        if self.status is None:  # still what the object shows
            self.status = old.status
        if (old.spec.source, old.spec.sha256) == (self.spec.source, self.spec.sha256):
            for name in ("verified", "outdated", "current_digest", "busy_since", "update_refused", "serving_path",
                         "serving_digest", "next_probe", "probe_delay", "previous_digest", "replica_refused",
                         "fetch_retrying"):
                setattr(self, name, getattr(old, name))
        else:  # a new sha256 alone leaves copies of the right content alone (check_loaded decides)
            self.outdated = old.outdated or old.spec.source != self.spec.source
            # The old spec's content only if some copy held it (refused, or loaded by us); an edit
            # made before the previous one was judged keeps what was serving before that.
            held = old.target_digest if (old.update_refused or old.verified) else None
            self.previous_digest = held or old.previous_digest or (old.status or {}).get("digest")


@dataclass(slots=True)
class RoundResult:
    actions: int = 0
    errors: int = 0
    changed: bool = False


def in_use(inventories: Mapping[str, AdapterInventory], now: float, idle_s: float) -> dict[str, set[str]]:
    """Pod -> adapters with requests in flight or used within `idle_s`, as of each inventory's poll.

    Idleness is the worker's own `idle_s` (its clock, at its answer), not `now - last_used`: that
    would compare two machines' clocks, and between polls (a round woken by an event reuses the
    last inventory) count the inventory's age as idle time. A use after the poll shows at the next
    one; until then the copy is judged on what the poll saw. `now - last_used` (unix seconds) only
    for a worker that does not report `idle_s`."""

    def idle(a: AdapterInfo) -> float | None:
        if a.idle_s is not None:
            return a.idle_s
        return None if a.last_used is None else now - a.last_used

    return {
        pod: {a.name for a in inv.adapters if a.requests_in_flight > 0 or ((t := idle(a)) is not None and t < idle_s)}
        for pod, inv in inventories.items()
    }


def check_loaded(
    adapters: Mapping[str, AdapterRecord],
    inventories: Mapping[str, AdapterInventory],
    loaded: Mapping[str, set[str]],
    max_lora_rank: int,
) -> None:
    """Permanent failures visible only after a load: digest or rank as reported by the worker.

    A digest that differs fails the adapter only on a copy this operator loaded from the current
    spec: any other copy (loaded before the spec's sha256 or source changed, or by a router) may
    just be an old version, which `stale_copies` has reloaded first."""
    for pod, inv in inventories.items():
        for info in inv.adapters:
            record = adapters.get(info.name)
            if record is None or record.problem is not None or info.name not in loaded.get(pod, ()):
                continue
            if not digest_matches(record.spec.sha256, info.digest):
                if pod in record.verified and not record.update_refused:  # the spec's content, loaded by us
                    record.failure = ("DigestMismatch", f"worker {pod} reports {info.digest}, spec wants sha256:{record.spec.sha256}")
            elif info.rank > max_lora_rank:
                record.failure = ("RankTooHigh", f"rank {info.rank} exceeds maxLoraRank {max_lora_rank}")


def sync_verified(adapters: Mapping[str, AdapterRecord], inventories: Mapping[str, AdapterInventory]) -> None:
    """Forget a pod's verified copy once a poll shows it gone or holding other content (an unload, a
    restarted worker, a router's load of another version there)."""
    for pod, inv in inventories.items():
        listed = {a.name: a.digest for a in inv.adapters}
        for record in adapters.values():
            seen = record.verified.get(pod)
            if seen is not None and not (record.spec.name in listed and same_digest(listed[record.spec.name], seen)):
                del record.verified[pod]


def stale_copies(adapters: Mapping[str, AdapterRecord], inventories: Mapping[str, AdapterInventory]) -> set[tuple[str, str]]:
    """(pod, adapter) copies that may not hold the record's target content, to reload in place.

    Every entry of every inventory counts, whatever its tier (a disk-tier entry is read again from
    its old path on its next use). With the target's digest known (the spec's sha256, what a
    worker reported after this operator's own load, or the serving version's while an update is
    refused), a copy is stale when its digest differs; until then, when the source changed and
    this operator has not loaded that copy since. Copies this operator loaded are judged by
    `check_loaded` instead."""
    out = set()
    for pod, inv in inventories.items():
        for info in inv.adapters:
            record = adapters.get(info.name)
            if record is None or record.problem is not None or pod in record.verified:
                continue
            target = record.target_digest
            if not same_digest(info.digest, target) if target is not None else record.outdated:
                out.add((pod, info.name))
    return out


def serving_version(record: AdapterRecord, copies: Sequence[AdapterInfo]) -> AdapterInfo | None:
    """The version to keep serving when the spec's content is refused: a copy (resident first) of
    the content the previous spec served (which may be the refused bytes themselves, when only
    the sha256 changed). None when that content is unknown or no copy has it: a first version, or
    leftovers of some other adapter of that name, are no version to fall back on."""
    previous = record.previous_digest
    matching = [c for c in copies if previous is not None and same_digest(c.digest, previous)]
    return max(matching, key=lambda c: c.tier in RESIDENT_TIERS) if matching else None


def info_of(inventory: AdapterInventory | None, name: str) -> AdapterInfo | None:
    """What `inventory` lists for `name`, if anything."""
    if inventory is None:
        return None
    return next((a for a in inventory.adapters if a.name == name), None)


def copy_digest(inventory: AdapterInventory | None, name: str) -> str | None:
    """The digest `inventory` lists for `name`, if it lists it."""
    info = info_of(inventory, name)
    return info.digest if info is not None else None


def holds(inventory: AdapterInventory, name: str, digest: str) -> bool:
    """Whether `inventory` has a resident copy of `name` with `digest`."""
    return any(a.name == name and a.tier in RESIDENT_TIERS and same_digest(a.digest, digest) for a in inventory.adapters)


def without(loaded: Mapping[str, set[str]], copies: set[tuple[str, str]]) -> dict[str, set[str]]:
    """`loaded` less some (pod, adapter) copies."""
    return {pod: {n for n in names if (pod, n) not in copies} for pod, names in loaded.items()}


def ready_replicas(pods: Mapping[str, PodState], loaded: Mapping[str, set[str]], adapter: str) -> int:
    return sum(
        1
        for pod, names in loaded.items()
        if adapter in names and (p := pods.get(pod)) is not None and p.in_service
    )


def note_digests(digests: dict[str, str], inventory: AdapterInventory) -> None:
    for info in inventory.adapters:
        digests[info.name] = info.digest


def digest_of(loaded: Mapping[str, set[str]], digests: Mapping[str, str], adapter: str,
              inventories: Mapping[str, AdapterInventory] | None = None, target: str | None = None) -> str | None:
    """The digest to show for a loaded adapter: its target's when a loaded copy has it, else the
    last one a worker reported."""
    if not any(adapter in names for names in loaded.values()):
        return None
    if target and inventories is not None:  # "": a server that reports no digests (stock vLLM)
        if any(holds(inv, adapter, target) for inv in inventories.values()):
            return target if target.startswith("sha256:") else f"sha256:{target}"
    return digests.get(adapter) or None


def status_writes(
    adapters: Mapping[str, AdapterRecord],
    pods: Mapping[str, PodState],
    inventories: Mapping[str, AdapterInventory],
    loaded: Mapping[str, set[str]],
    digests: Mapping[str, str],
    target: placement.Assignment | None,
    loading: set[str],
    reason: str,
    message: str,
) -> list[tuple[AdapterRecord, dict[str, Any]]]:
    """The adapters whose status changes, each with its new status."""
    usable = sum(1 for p in pods.values() if p.ready and not p.draining and p.name in inventories)
    writes: list[tuple[AdapterRecord, dict[str, Any]]] = []
    for record in list(adapters.values()):
        name = record.spec.name
        # No target: the pool is deleted or invalid, and even a min-0 adapter is not served (not Ready).
        wanted = target.wanted.get(name, record.spec.min_replicas) if target else max(record.spec.min_replicas, 1)
        placed = len(target.pods.get(name, ())) if target else 0
        why, detail = reason, message
        if target is not None and placed < wanted:
            why = "NotEnoughWorkers" if usable < wanted else "InsufficientCapacity"
            detail = f"{placed}/{wanted} replicas assigned ({usable} usable workers)"
        obs = AdapterObservation(
            generation=record.generation,
            desired=wanted,
            placed=placed,
            ready=ready_replicas(pods, loaded, name),
            loading=name in loading,
            failure=record.problem,
            update_refused=record.update_refused,
            replica_refused=record.replica_refused,
            fetch_retrying=record.fetch_retrying,
            placed_reason=why,
            placed_message=detail,
            digest=digest_of(loaded, digests, name, inventories, record.target_digest),
            # What the copies were loaded from: the spec's, once no copy of an older source is left.
            source=(record.status or {}).get("source") if record.outdated else record.spec.source,
        )
        new = adapter_status(obs, record.status)
        if status_changed(record.status, new):
            writes.append((record, new))
    return writes


def pool_status_of(pool: PoolSpec, pods: Mapping[str, PodState], adapters: Mapping[str, AdapterRecord]) -> dict[str, Any]:
    """The LoraPool's status: its workers and how many of its adapters are Ready."""
    ready = sum(1 for p in pods.values() if p.in_service)
    ready_adapters = sum(1 for r in adapters.values() if (r.status or {}).get("phase") == "Ready")
    phase = pool_phase(pool.replicas, ready)
    return {
        "phase": phase,
        "replicas": len(pods),
        "readyReplicas": ready,
        "readyAdapters": ready_adapters,
        "adminTokenSecret": pool.token_secret,
    }

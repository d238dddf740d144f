"""Status phase machine and conditions (pure).

Phases of a LoraAdapter:
  Failed    a permanent error (invalid spec, rank too high, digest mismatch, load refused),
            left alone until the spec changes; or its name served by another namespace's adapter.
  Ready     readyReplicas >= desiredReplicas.
  Loading   loads are in flight and fewer replicas than desired are ready.
  Degraded  some replicas ready, fewer than desired, nothing in flight (e.g. short of capacity).
  Pending   nothing loaded and nothing in flight (no pool, no ready worker, no room).
A Ready condition with reason FetchRetrying: a load's fetch of a remote source keeps failing
transiently (the worker's reason and message; the phase stays Loading or Pending meanwhile).
Status carries aggregates only (counts, conditions), never a list of pods.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MESSAGE_MAX = 32768  # metav1.Condition's bound on message (the CRDs' schema has it too)


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class AdapterObservation:
    """What the reconciler knows about one adapter after a round."""

    generation: int | None
    desired: int
    placed: int  # pods the placement assigned (may be < desired when capacity is short)
    ready: int
    loading: bool
    failure: tuple[str, str] | None = None  # (reason, message), permanent
    placed_reason: str = "Placed"
    placed_message: str = ""
    digest: str | None = None
    source: str | None = None  # the spec.source the loaded copies come from
    update_refused: tuple[str, str] | None = None  # (reason, message): the old version still serves
    # (reason, message): a new replica's worker refused the content the others serve (e.g. an
    # object changed since the digest was recorded): they keep serving, no replica is added.
    replica_refused: tuple[str, str] | None = None
    # (worker reason, message): the last load's fetch of the remote source failed transiently and
    # is retried (reason FetchRetrying on Ready while fewer replicas than desired are loaded).
    fetch_retrying: tuple[str, str] | None = None


def adapter_phase(obs: AdapterObservation) -> str:
    if obs.failure is not None:
        return "Failed"
    if obs.ready >= obs.desired:
        return "Ready"
    if obs.replica_refused is not None:
        return "Degraded" if obs.ready > 0 else "Pending"
    if obs.loading:
        return "Loading"
    return "Degraded" if obs.ready > 0 else "Pending"


def adapter_conditions(obs: AdapterObservation) -> list[Condition]:
    if obs.failure is not None:
        reason, message = obs.failure
        validated = Condition("Validated", False, reason, message)
        return [validated, Condition("Placed", False, reason, ""), Condition("Ready", False, reason, message)]
    placed_ok = obs.placed >= obs.desired
    ready_ok = obs.ready >= obs.desired
    placed_message = obs.placed_message or f"{obs.placed}/{obs.desired} replicas assigned"
    ready_message = f"{obs.ready}/{obs.desired} replicas loaded"
    if ready_ok and obs.update_refused is not None:  # serving, but not what the spec asks for
        ready_reason = "UpdateRefused"
        ready_message = (f"{ready_message} from source {obs.source!r}, the version before this spec's; "
                         f"the update was refused: {obs.update_refused[1]}")
    elif ready_ok:
        ready_reason = "Loaded"
    elif obs.replica_refused is not None:
        ready_reason = obs.replica_refused[0]
        ready_message = f"{ready_message}; a new replica refused the content the others serve: {obs.replica_refused[1]}"
    elif obs.fetch_retrying is not None:
        ready_reason = "FetchRetrying"
        why, detail = obs.fetch_retrying
        ready_message = f"{ready_message}; fetching the source failed ({why}), retrying: {detail}"
    elif obs.loading:
        ready_reason = "Loading"
    elif not placed_ok:  # why it is not loaded: the placement's reason (e.g. PoolNotFound), not "NotLoaded"
        ready_reason, ready_message = obs.placed_reason, f"{ready_message}: {placed_message}"
    else:
        ready_reason = "NotLoaded"
    conditions = [
        Condition("Validated", True, "Valid", ""),
        Condition("Placed", placed_ok, "Placed" if placed_ok else obs.placed_reason, placed_message),
        Condition("Ready", ready_ok, ready_reason, ready_message),
    ]
    if obs.update_refused is not None:
        conditions.append(Condition("Updated", False, *obs.update_refused))
    return conditions


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_conditions(
    conditions: Sequence[Condition], previous: Sequence[Mapping[str, Any]] | None, generation: int | None
) -> list[dict[str, Any]]:
    """Kubernetes condition dicts; lastTransitionTime moves only when a condition's status flips."""
    before = {c.get("type"): c for c in previous or ()}
    out = []
    for c in conditions:
        status = "True" if c.status else "False"
        old = before.get(c.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        item: dict[str, Any] = {
            "type": c.type,
            "status": status,
            "reason": c.reason,
            "message": c.message[:MESSAGE_MAX],
            "lastTransitionTime": since or _now(),
        }
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    return out


def adapter_status(obs: AdapterObservation, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    previous = previous or {}
    status: dict[str, Any] = {
        "phase": adapter_phase(obs),
        "readyReplicas": obs.ready,
        "desiredReplicas": obs.desired,
        "conditions": render_conditions(adapter_conditions(obs), previous.get("conditions"), obs.generation),
    }
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    if obs.digest:
        status["digest"] = obs.digest
    if obs.source:
        status["source"] = obs.source
    return status


def _essence(status: Mapping[str, Any] | None) -> Any:
    """A status without timestamps, to decide whether a write is needed at all."""
    if not status:
        return None
    conds = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or ()
    ]
    rest = {k: v for k, v in status.items() if k not in ("conditions", "kopf")}
    return rest, conds


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    return _essence(old) != _essence(new)


def pool_phase(desired: int, ready: int, failure: str | None = None) -> str:
    if failure:
        return "Failed"
    if ready >= desired:
        return "Ready"
    return "Progressing" if ready == 0 else "Degraded"

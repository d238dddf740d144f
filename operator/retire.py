"""Worker pods that go away without taking an adapter to zero copies: pure decisions, no I/O.

Pods go away in a rollout (a new pod template: the Deployment surges one new pod, then removes an
old one once the new one is Ready) and in a scale-down. Three Kubernetes mechanisms, driven from
here, make sure that every adapter the placement wants somewhere keeps a serving copy meanwhile:

- A readiness gate (`GATE`) on every worker pod: a pod is Ready (for the Deployment, the Service
  and the routers' discovery) only once the operator set that condition, which it does when the pod
  holds the adapters the placement gives it and the pods about to be removed hold no adapter that
  has no copy on a pod that stays. So the Deployment removes no old pod before its adapters serve
  elsewhere, and with no operator running (killed mid-rollout) the rollout just waits.
- `controller.kubernetes.io/pod-deletion-cost`: the pods chosen to go (`retiring`) get the lowest
  cost, so the ReplicaSet removes exactly them; the others get the number of adapters they alone
  hold, so a scale-down made behind the operator's back also removes pods holding copies that
  exist elsewhere first.
- A scale-down is staged: the Deployment keeps its replicas until the retiring pods are emptied
  (their adapters loaded on the pods that stay), then the operator lowers them.

The retiring pods and the gates are read back from the pods (annotation, condition), so an operator
taking over mid-rollout continues with the same pods rather than choosing again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lorafleet.operator import placement
from lorafleet.operator.pool_state import PodState

GATE = "lorafleet.dev/adapters-loaded"  # the readiness gate's condition type
COST = "controller.kubernetes.io/pod-deletion-cost"
RETIRING_COST = -1  # below every other pod's (they get 0 or more): the ReplicaSet removes these first


def alive(pods: Mapping[str, PodState]) -> list[PodState]:
    """Pods that are not terminating."""
    return [p for p in pods.values() if not p.draining]


def newest_revision(pods: Iterable[PodState]) -> str | None:
    """The pod template being rolled out: that of the pods waiting at their gate, else of the
    pod created last."""
    pods = list(pods)
    waiting = [p for p in pods if p.gated and not p.gate_open]
    pick = waiting or pods
    return max(pick, key=lambda p: (p.created, p.name)).revision if pick else None


def sole_copies(pods: Mapping[str, PodState], loaded: Mapping[str, set[str]], names: set[str],
                leaving: set[str] = frozenset()) -> dict[str, int]:
    """Serving pod -> how many of `names` it alone holds among the serving pods not `leaving`."""
    serving = [p.name for p in pods.values() if p.in_service and p.name not in leaving and p.name in loaded]
    holders: dict[str, list[str]] = {}
    for pod in serving:
        for name in loaded[pod] & names:
            holders.setdefault(name, []).append(pod)
    out = dict.fromkeys(serving, 0)
    for where in holders.values():
        if len(where) == 1:
            out[where[0]] += 1
    return out


def retiring(pods: Mapping[str, PodState], replicas: int, loaded: Mapping[str, set[str]], names: set[str]) -> set[str]:
    """The serving pods to empty before they go: as many as the pods not terminating exceed
    `replicas`. In a rollout only pods of an older template (the Deployment removes those); in a
    scale-down any pod. Pods already marked retiring stay so (an operator that takes over keeps
    them); then the pods holding the fewest adapters alone, the fewest copies, by name."""
    live = alive(pods)
    surplus = len(live) - replicas
    if surplus <= 0:
        return set()
    serving = [p for p in live if p.in_service]
    if len({p.revision for p in live}) > 1:
        newest = newest_revision(live)
        serving = [p for p in serving if p.revision != newest or p.cost == RETIRING_COST]
    sole = sole_copies(pods, loaded, names)

    def key(p: PodState) -> tuple[bool, int, int, str]:
        return (p.cost != RETIRING_COST, sole.get(p.name, 0), len(loaded.get(p.name, ())), p.name)

    return {p.name for p in sorted(serving, key=key)[:surplus]}


def evacuated(leaving: set[str], pods: Mapping[str, PodState], loaded: Mapping[str, set[str]],
              target: placement.Assignment, opening: set[str] = frozenset()) -> bool:
    """Whether the `leaving` pods may go: every adapter on them that the placement wants somewhere
    has a copy on a pod that stays and serves (or is `opening` its gate now), or the placement
    finds no room for it on the pods that stay (waiting would not help). A leaving pod not polled
    yet may hold anything: not evacuated."""
    staying = {p.name for p in alive(pods) if p.name not in leaving and (p.in_service or p.name in opening)}
    for pod in leaving:
        if pod not in loaded:
            return False
        for name in loaded[pod]:
            if target.wanted.get(name, 0) <= 0 or any(name in loaded.get(q, ()) for q in staying):
                continue
            if target.pods.get(name):  # placed on a pod that stays: its load is still to come
                return False
    return True


def holds_share(pod: str, loaded: Mapping[str, set[str]], target: placement.Assignment) -> bool:
    """The pod holds every adapter the placement gives it."""
    have = loaded.get(pod)
    return have is not None and all(name in have for name, where in target.pods.items() if pod in where)


def gates_to_open(pods: Mapping[str, PodState], loaded: Mapping[str, set[str]], target: placement.Assignment,
                  leaving: set[str]) -> set[str]:
    """Pods whose gate the operator sets now: each holds its share, and once they serve, the
    `leaving` pods may go (the Deployment removes an old pod as soon as a new one is Ready)."""
    opening = {p.name for p in alive(pods) if p.gated and not p.gate_open and p.ready and p.ip
               and holds_share(p.name, loaded, target)}
    if opening and leaving and not evacuated(leaving, pods, loaded, target, opening):
        return set()
    return opening


def deletion_costs(pods: Mapping[str, PodState], loaded: Mapping[str, set[str]], names: set[str],
                   leaving: set[str]) -> dict[str, int]:
    """The pod-deletion-cost each serving pod should carry: `RETIRING_COST` for the leaving ones,
    else how many adapters it alone holds (pods whose copies all exist elsewhere go first). The
    operator opens no gate and lowers no replicas until the pods carry these: the ReplicaSet
    chooses by the costs the pods have, not the ones about to be written."""
    sole = sole_copies(pods, loaded, names, leaving)
    out = {p: RETIRING_COST for p in leaving}
    for pod, count in sole.items():
        out.setdefault(pod, count)
    for p in alive(pods):  # retiring no more, not polled yet: at least not removed first
        if p.cost == RETIRING_COST:
            out.setdefault(p.name, 0)
    return out

"""The three scheduling interfaces (Filter → Scorer → Picker) and the values they pass around.

Everything here is pure data: the gateway builds `EndpointView`s from live state, the fleet
simulator builds them from its virtual workers, and both call the same policies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, TypeVar

_T = TypeVar("_T")

Reason = Literal["hot", "warm", "cold", "base"]


@dataclass(frozen=True, slots=True)
class EndpointView:
    """One replica as the scheduler sees it at decision time."""

    name: str
    model: str = "base"  # the base model's served name
    healthy: bool = True
    ejected: bool = False
    gpu: frozenset[str] = frozenset()  # adapters in GPU slots
    cpu: frozenset[str] = frozenset()  # adapters in the CPU cache (a superset of `gpu` on vLLM)
    active: frozenset[str] = frozenset()  # adapters with requests running
    waiting_adapters: frozenset[str] = frozenset()  # adapters with requests queued
    running: int = 0
    waiting: int = 0
    inflight: int = 0  # requests the router has sent and not seen finish (fresher than a poll)
    max_loras: int = 16
    max_cpu_loras: int = 64
    capacity: int = 64  # max concurrent sequences; normalises load
    pinned: frozenset[str] = frozenset()

    @property
    def load(self) -> int:
        # The poll lags; the router's own count does not. Take the larger.
        return max(self.running + self.waiting, self.inflight)

    def tier(self, adapter: str) -> Literal["gpu", "cpu"] | None:
        if adapter in self.gpu:
            return "gpu"
        if adapter in self.cpu:
            return "cpu"
        return None

    @property
    def resident(self) -> frozenset[str]:
        return self.gpu | self.cpu

    def slots_over(self, adapters: tuple[str, ...]) -> int:
        """Adapters beyond `max_loras` once `adapters` join: how many must drain before all get a GPU slot.

        Counts every adapter running or queued here plus the request's own: 0 means the request can
        join the next batch; k > 0 means it waits until k adapters have drained (its own place in
        the queue included). vLLM frees a slot only when an adapter has no request left running, so
        each place in that queue costs a large share of a request's lifetime.
        """
        if not adapters:
            return 0
        return max(0, len(self.active | self.waiting_adapters | frozenset(adapters)) - self.max_loras)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What scheduling needs to know about one request."""

    model: str  # base model served name
    adapters: tuple[str, ...] = ()  # () = base model only; several = an RFC composed request
    share: float = 0.0  # this key's share of recent requests (set by the policy from its sketch)

    @property
    def key(self) -> str:
        """Hash key: requests for the same adapter set concentrate on the same replicas."""
        return "+".join(sorted(self.adapters)) if self.adapters else self.model


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """What to do with a replica's CPU cache around a cold load (see `admission.py`)."""

    unload_before: tuple[str, ...] = ()  # evict these first (explicit, frequency-aware victims)
    admit: bool = True  # False: serve, then unload once idle (the adapter is not worth a slot)


@dataclass(frozen=True, slots=True)
class Decision:
    endpoint: EndpointView
    reason: Reason
    needs_load: tuple[str, ...] = ()  # adapters to load on `endpoint` before sending
    admission: AdmissionPlan = field(default_factory=AdmissionPlan)


def positional_maker(cls: type[_T]) -> Callable[..., _T]:
    """`cls(*values)` for a frozen, slotted dataclass, every field given in order, without its
    `__init__`'s `object.__setattr__` per field: each slot's descriptor sets it (an `EndpointView`
    in 0.7 µs against 1.9). For the router's per-decision objects; no `__post_init__` runs."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    env: dict[str, Any] = {"new": object.__new__, "cls": cls}
    env.update({f"set_{n}": getattr(cls, n).__set__ for n in names})
    body = "".join(f"    set_{n}(v, {n})\n" for n in names)
    exec(f"def make({', '.join(names)}):\n    v = new(cls)\n{body}    return v\n", env)
    make = env["make"]
    make.__qualname__ = f"positional_maker({cls.__name__})"
    return make


make_view: Callable[..., EndpointView] = positional_maker(EndpointView)
make_decision: Callable[..., Decision] = positional_maker(Decision)
make_plan: Callable[..., AdmissionPlan] = positional_maker(AdmissionPlan)


@dataclass(frozen=True, slots=True)
class FleetStats:
    """Fleet-wide numbers some scorers and filters compare against."""

    total_load: int
    n_endpoints: int
    # Of the replicas that can take the request (healthy, not ejected, serving its model): how many,
    # and how many have every GPU slot taken or asked for (|active ∪ waiting| ≥ max_loras).
    serving: int = 0
    slot_full: int = 0

    @classmethod
    def of(cls, endpoints: Sequence[EndpointView], model: str | None = None) -> FleetStats:
        serving = slot_full = 0
        if model is not None:
            for e in endpoints:
                if e.healthy and not e.ejected and e.model == model:
                    serving += 1
                    slot_full += len(e.active | e.waiting_adapters) >= e.max_loras
        return cls(sum(e.load for e in endpoints), len(endpoints), serving, slot_full)


class Filter(Protocol):
    name: str

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]: ...


class Scorer(Protocol):
    name: str

    def __call__(self, req: RequestInfo, endpoint: EndpointView, stats: FleetStats) -> float:
        """A score in [0, 1]; higher is better. Callers clamp anyway."""


class Picker(Protocol):
    name: str

    def __call__(self, req: RequestInfo, scored: Sequence[tuple[EndpointView, float]]) -> EndpointView: ...


class NoEndpoint(Exception):
    """No replica can take the request (all unhealthy, ejected or serving another base model)."""

"""Pickers: choose one replica from the scored candidates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafleet.router.scheduling.types import EndpointView, NoEndpoint, RequestInfo

_TIE = 1e-9


@dataclass(slots=True)
class MaxScore:
    """Highest score; exact ties rotate so equal replicas share work instead of the first taking all."""

    name: str = "max-score"
    _turn: int = field(default=0, repr=False)

    def __call__(self, req: RequestInfo, scored: Sequence[tuple[EndpointView, float]]) -> EndpointView:
        if not scored:
            raise NoEndpoint("no candidate replica")
        best = max(score for _, score in scored)
        tied = sorted((e for e, score in scored if score >= best - _TIE), key=lambda e: e.name)
        if len(tied) == 1:
            return tied[0]
        self._turn += 1
        return tied[self._turn % len(tied)]


@dataclass(slots=True)
class RoundRobin:
    """Ignores scores: each candidate in name order, in turn."""

    name: str = "round-robin"
    _turn: int = field(default=-1, repr=False)

    def __call__(self, req: RequestInfo, scored: Sequence[tuple[EndpointView, float]]) -> EndpointView:
        if not scored:
            raise NoEndpoint("no candidate replica")
        self._turn += 1
        ordered = sorted((e for e, _ in scored), key=lambda e: e.name)
        return ordered[self._turn % len(ordered)]

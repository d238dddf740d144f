"""Decayed request counts per adapter: the popularity signal behind cache admission.

TinyLFU-style aging: every `halve_every` recorded requests all counts are halved, so the estimate
follows shifts in popularity while remembering more than a recency list does. Memory is bounded by
`max_keys` (the smallest counts are dropped first).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class FrequencySketch:
    halve_every: int = 50_000
    max_keys: int = 100_000
    # Below this many recorded requests shares are noise (one request is 100% of traffic): report 0.
    min_total: float = 100.0
    _counts: dict[str, float] = field(default_factory=dict)
    _since_halving: int = 0
    _total: float = 0.0
    # Bumped whenever every estimate changes at once (halving, trimming): caches keyed on estimates
    # are stale.
    generation: int = 0

    def add(self, key: str, n: float = 1.0) -> None:
        self._counts[key] = self._counts.get(key, 0.0) + n
        self._total += n
        self._since_halving += 1
        if self._since_halving >= self.halve_every:
            self._halve()
        elif len(self._counts) > self.max_keys:
            self._trim()

    def estimate(self, key: str) -> float:
        return self._counts.get(key, 0.0)

    def share(self, key: str) -> float:
        """Fraction of (decayed) recent requests that were for `key`."""
        if self._total < self.min_total:
            return 0.0
        return self._counts.get(key, 0.0) / self._total

    def __len__(self) -> int:
        return len(self._counts)

    def _halve(self) -> None:
        self.generation += 1
        self._since_halving = 0
        self._counts = {k: v / 2 for k, v in self._counts.items() if v >= 0.5}
        self._total = sum(self._counts.values())

    def _trim(self) -> None:
        self.generation += 1
        keep = sorted(self._counts.items(), key=lambda kv: kv[1], reverse=True)[: self.max_keys * 9 // 10]
        self._counts = dict(keep)
        self._total = sum(self._counts.values())

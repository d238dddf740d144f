"""Decayed request counts per adapter: the popularity signal behind cache admission.

TinyLFU-style aging: every `halve_every` recorded requests all counts are halved, so the estimate
follows shifts in popularity while remembering more than a recency list does. Memory is bounded by
`max_keys` (the smallest counts are dropped first).

Counts are kept in units of `unit` (2 ** the halvings since the last rescale): a halving doubles
the unit instead of touching every count, so it costs nothing and keeps the counts' order, and
anything ordered by them (the router's per-replica popularity heaps) stays valid across it. Powers
of two keep the arithmetic exact: `estimate` is the decayed count to the last bit. Past 2 ** 32, or at an
aging while more than half of `max_keys` are held, the counts are rescaled to unit 1 and those under half
a request dropped (a `generation` change).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_RESCALE_AT = 2.0**32  # unit at which counts are rescaled: sums stay well under 2 ** 53 (exact)


@dataclass(slots=True)
class FrequencySketch:
    halve_every: int = 50_000
    max_keys: int = 100_000
    # Below this many recorded requests shares are noise (one request is 100% of traffic): report 0.
    min_total: float = 100.0
    counts: dict[str, float] = field(default_factory=dict)  # in units (read-only outside)
    _since_halving: int = 0
    _total: float = 0.0  # in units
    unit: float = 1.0
    # Bumped whenever counts change other than by growing (a rescale, a trim): caches ordered by
    # counts are stale. A halving is not such a change.
    generation: int = 0

    def add(self, key: str, n: float = 1.0) -> None:
        n *= self.unit
        self.counts[key] = self.counts.get(key, 0.0) + n
        self._total += n
        self._since_halving += 1
        if self._since_halving >= self.halve_every:
            self._halve()
        elif len(self.counts) > self.max_keys:
            self._trim()

    def estimate(self, key: str) -> float:
        return self.counts.get(key, 0.0) / self.unit

    def count(self, key: str) -> float:
        """The count in units: ordered as `estimate`, and it only grows within a generation."""
        return self.counts.get(key, 0.0)

    def share(self, key: str) -> float:
        """Fraction of (decayed) recent requests that were for `key`."""
        if self._total < self.min_total * self.unit:
            return 0.0
        return self.counts.get(key, 0.0) / self._total

    def age_with(self, cache_slots: int, per_slot: float, floor: int) -> None:
        """Set the aging period from the fleet's adapter cache: `per_slot` requests per CPU slot, at
        least `floor`. What the cache must tell apart is the adapters around its capacity's rank;
        with Zipf popularity their share of requests falls about as fast as the capacity grows, so
        a memory in proportion to the capacity keeps their expected counts (what admission compares)
        about the same from 8 replicas to 1,000. A fixed period dilutes them: at 256 replicas ×
        64 slots, with counts halved every 50,000 requests, the adapter ranked 16,000 of 50,000 has
        about one request in the sketch's memory, and admission cannot tell it from one ranked
        30,000."""
        self.halve_every = max(floor, int(per_slot * cache_slots))

    def __len__(self) -> int:
        return len(self.counts)

    def _halve(self) -> None:
        self._since_halving = 0
        self.unit *= 2.0
        # Rescaling also drops the keys under half a request: done when more than half of `max_keys`
        # are held, so a large catalog's one-off keys go at agings, not at a (sorting) trim.
        if self.unit >= _RESCALE_AT or len(self.counts) > self.max_keys // 2:
            self._rescale()

    def _rescale(self) -> None:
        self.generation += 1
        unit = self.unit
        self.counts = {k: v / unit for k, v in self.counts.items() if v >= 0.5 * unit}
        self._total = sum(self.counts.values())
        self.unit = 1.0

    def _trim(self) -> None:
        self.generation += 1
        keep = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)[: self.max_keys * 9 // 10]
        self.counts = dict(keep)
        self._total = sum(self.counts.values())

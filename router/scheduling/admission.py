"""Frequency-aware cache admission for a replica's CPU adapter cache, driven by the router.

Workers evict least-recently-used adapters (vLLM's CPU cache). Under a Zipf popularity, LRU lets a
one-off request for a rare adapter push out a popular one, which then misses again. The router
holds the only fleet-wide popularity signal, so it decides:

- keep `scratch_slots` of each cache free for adapters that are not worth a slot;
- a cold adapter more popular than the replica's least popular idle resident is *admitted*: that
  resident is unloaded first (an explicit LFU victim instead of the worker's LRU one);
- otherwise it is loaded into a scratch slot, served, and unloaded once idle;
- so is a *spill copy* (`transient=True`): an adapter that has a home elsewhere, loaded here
  only because that home was too busy. Admitting it would take a slot from an adapter with no
  other copy, for a second copy of one that has.

Pure: reads an `EndpointView` and a frequency estimate, returns an `AdmissionPlan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.router.scheduling.types import AdmissionPlan, EndpointView


@dataclass(frozen=True, slots=True)
class FrequencyAdmission:
    scratch_slots: int = 1
    # A newcomer must beat the victim by this factor: stops two similar adapters swapping places.
    margin: float = 1.0

    def plan(
        self,
        adapters: tuple[str, ...],
        endpoint: EndpointView,
        frequency: Callable[[str], float],
        transient: bool = False,
    ) -> AdmissionPlan:
        missing = [a for a in adapters if a not in endpoint.resident]
        if not missing:
            return AdmissionPlan()
        resident = endpoint.resident
        free = endpoint.max_cpu_loras - len(resident)
        if free - len(missing) >= self.scratch_slots and not transient:
            return AdmissionPlan(admit=True)
        busy = endpoint.active | endpoint.waiting_adapters | endpoint.pinned | set(adapters)
        victims = sorted((frequency(a), a) for a in resident if a not in busy)
        if not transient:
            newcomer = min(frequency(a) for a in missing)
            need = self.scratch_slots + len(missing) - free  # slots to free to keep the scratch reserve
            chosen: list[str] = []
            for freq, name in victims[: max(0, need)]:
                if newcomer <= freq * self.margin:
                    break
                chosen.append(name)
            if len(chosen) >= need:
                return AdmissionPlan(unload_before=tuple(chosen), admit=True)
        # Not worth a slot: borrow scratch space. If even the scratch is full, free the least
        # popular idle residents rather than let the worker's LRU pick a popular one.
        overflow = len(missing) - free
        return AdmissionPlan(
            unload_before=tuple(name for _, name in victims[: max(0, overflow)]), admit=False
        )

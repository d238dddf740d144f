"""Adapter tiers: disk (a known PEFT folder) -> CPU cache (LRU, `max_cpu_loras`) -> GPU slots (`max_loras`).

Invariants: an adapter on a GPU slot is also in the CPU cache; an adapter with requests in flight
or pinned is never evicted from either; validation of a new adapter finishes before anything is
evicted. Single-threaded by design: the engine loop owns it (disk reads can run in a thread
through `read`, then `insert_cpu` on the loop).

`read` does all the per-adapter work, off the loop (worker/lora/reader.py): validation, the
digest, and the adapter's CPU-cache copy in exactly the slot layout, checked for NaN/Inf. Filling a
slot is then only plain copies, and `insert_cpu` only files the adapter. The latest adapters read
keep their layout on the GPU until their first fill (`GPU_COPIES_KEPT`): a cold load's fill is then
a copy on the GPU instead of one over PCIe.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from lorafleet.protocol import REASON_DRAINING
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.lora.adapter import AdapterError, LoraWeights
from lorafleet.worker.lora.digest import Digest
from lorafleet.worker.lora.dora import BaseWeight, LoopDoraScales, prepare_dora
from lorafleet.worker.lora.packing import pack_weights
from lorafleet.worker.lora.reader import AdapterReader
from lorafleet.worker.lora.slots import LoraSlots

# Adapters read last keep their slot layout on the GPU until it fills a slot: at most this many
# (the most recently used in the CPU cache), and at most this many bytes of them.
GPU_COPIES_KEPT = 2
GPU_COPIES_KEPT_BYTES = 512 << 20


class AdapterConflict(AdapterError):
    """The name is taken by an adapter with different content (HTTP 409)."""


class AdapterNotFound(AdapterError):
    """No adapter of that name is registered (HTTP 404)."""


@dataclass(slots=True)
class AdapterEntry:
    name: str
    path: str
    digest: Digest  # may still be hashing: `digest.value` waits (off the engine thread where it can)
    rank: int
    alpha: float
    pinned: bool = False
    in_flight: int = 0
    last_used: float | None = None
    slot: int | None = None
    removed: bool = False  # unloaded while requests were in flight: freed when the last one ends
    generation: int = 0  # unique per registration: what the prefix cache keys this content by
    dora: bool = False  # a DoRA adapter: served only as a request's one adapter, at scale 1


@dataclass(slots=True)
class TierStats:
    cpu_hits: int = 0
    cpu_misses: int = 0  # had to read from disk
    gpu_hits: int = 0
    gpu_misses: int = 0  # had to copy CPU -> GPU
    cpu_evictions: int = 0
    gpu_evictions: int = 0
    # Load latencies not yet taken by a metrics scrape; capped so an unscraped worker stays bounded.
    load_seconds: dict[str, list[float]] = field(default_factory=lambda: {"disk": [], "cpu": []})

    def record_load(self, tier: str, seconds: float, cap: int = 4096) -> None:
        samples = self.load_seconds.setdefault(tier, [])
        samples.append(seconds)
        if len(samples) > cap:
            del samples[: len(samples) - cap]


class AdapterRegistry:
    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        slots: LoraSlots | None,
        dtype: torch.dtype,
        clock: Callable[[], float] = time.time,
        base_weight: BaseWeight | None = None,
        loop_dora: LoopDoraScales | None = None,
    ) -> None:
        """`base_weight`: the model's weight of a (layer, target), for DoRA's norms (None: DoRA
        adapters are refused, unless `loop_dora` computes them in `insert_cpu`, on the engine loop)."""
        self.model = model
        self.engine = engine
        self.slots = slots
        self.dtype = dtype
        self.clock = clock
        self.entries: dict[str, AdapterEntry] = {}
        self._generations = itertools.count(1)
        self.cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # LRU first
        self._slot_owner: list[str | None] = [None] * engine.max_loras
        self._gpu_lru: OrderedDict[str, None] = OrderedDict()
        self.stats = TierStats()
        self._pin = slots is not None and slots.device.type == "cuda"
        self.base_weight = base_weight
        self.loop_dora = loop_dora
        self.reader = AdapterReader(model, engine, dtype, slots.device if self._pin else None, base_weight,
                                    defer_dora=loop_dora is not None)

    # -- catalogue -----------------------------------------------------------------------------
    def read(self, path: str) -> LoraWeights:
        """Validate, read and prepare an adapter folder (`AdapterReader.read`; safe to run in a
        thread: touches no registry state)."""
        return self.reader.read(path)

    def register(self, name: str, weights: LoraWeights, pinned: bool = False) -> tuple[AdapterEntry, bool]:
        """Add a validated adapter; returns (entry, created). Same content again is a no-op."""
        old = self.entries.get(name)
        if old is not None and not old.removed:
            if old.digest.value != weights.digest.value:
                raise AdapterConflict(
                    "conflict", f"adapter {name!r} is already loaded with different content ({old.digest.value}); "
                    "unload it first or load the new version under a new name",
                )
            old.pinned = old.pinned or pinned
            old.path = weights.path  # where it was last loaded from (an older folder may be gone)
            if name not in self.cpu:  # a disk-tier entry: the load asked for it resident, and it is read now
                self.insert_cpu(name, weights)
            return old, False
        if old is not None:  # the old version still drains requests in flight
            if old.digest.value == weights.digest.value:
                old.removed = False  # same content: simply take the unload back
                old.pinned = old.pinned or pinned
                return old, False
            # Its running requests must finish with the old weights, under this name: a second
            # version would share the name's slot and counters. Refuse until they are done.
            raise AdapterConflict(
                REASON_DRAINING, f"adapter {name!r} was unloaded and {old.in_flight} request(s) still run with its old "
                "weights; retry when they finish, or load the new version under a new name",
            )
        self._prepare(weights)  # may refuse it (DoRA's scales, when computed here): before it is filed
        entry = AdapterEntry(name=name, path=weights.path, digest=weights.digest, rank=weights.max_rank,
                             alpha=weights.alpha, pinned=pinned, generation=next(self._generations),
                             dora=weights.dora)
        self.entries[name] = entry
        self.insert_cpu(name, weights)
        return entry, True

    def unregister(self, name: str) -> AdapterEntry:
        """Forget an adapter. New requests no longer find it; requests in flight finish with it."""
        entry = self.get(name)
        entry.removed = True
        if entry.in_flight == 0:
            self._drop(name)
        return entry

    def get(self, name: str) -> AdapterEntry:
        entry = self.entries.get(name)
        if entry is None or entry.removed:
            raise AdapterNotFound("not_found", f"adapter {name!r} is not loaded on this worker")
        return entry

    def _entry(self, name: str) -> AdapterEntry:
        """Like `get`, but also finds an unloaded adapter that still drains its requests."""
        entry = self.entries.get(name)
        if entry is None:
            raise AdapterNotFound("not_found", f"adapter {name!r} is not loaded on this worker")
        return entry

    def is_dora(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.dora

    def names(self) -> list[str]:
        return [n for n, e in self.entries.items() if not e.removed]

    def tier(self, name: str) -> str:
        entry = self.entries[name]
        if entry.slot is not None:
            return "gpu"
        return "cpu" if name in self.cpu else "disk"

    def on_cpu(self, name: str) -> bool:
        return name in self.cpu

    # -- requests ------------------------------------------------------------------------------
    def acquire(self, names: Iterable[str]) -> None:
        """Count a request in flight (call when it is accepted; raises if an adapter is unknown)."""
        entries = [self.get(n) for n in names]
        now = self.clock()
        for entry in entries:
            entry.in_flight += 1
            entry.last_used = now

    def release(self, names: Iterable[str]) -> None:
        for name in names:
            entry = self.entries.get(name)
            if entry is None:
                continue
            if entry.in_flight <= 0:
                raise RuntimeError(f"adapter {name!r} released more often than acquired")
            entry.in_flight -= 1
            if entry.removed and entry.in_flight == 0:
                self._drop(name)

    # -- CPU tier ------------------------------------------------------------------------------
    def insert_cpu(self, name: str, weights: LoraWeights) -> None:
        """Put validated weights into the CPU cache (in the slot layout), evicting LRU."""
        self._prepare(weights)
        self.cpu[name] = weights
        self.cpu.move_to_end(name)
        self._evict_cpu(keep=name)
        self._trim_gpu_copies()

    def _trim_gpu_copies(self) -> None:
        """Let the least recently used GPU copies of layouts go beyond GPU_COPIES_KEPT / GPU_COPIES_KEPT_BYTES."""
        live = [w.packed for w in self.cpu.values() if w.packed.gpu_sources is not None]  # LRU first
        total = sum(p.nbytes for p in live)
        while live and (len(live) > GPU_COPIES_KEPT or total > GPU_COPIES_KEPT_BYTES):
            packed = live.pop(0)
            packed.release_gpu()
            total -= packed.nbytes

    def ensure_cpu(self, name: str) -> LoraWeights:
        """The adapter's weights, read from disk again if the CPU cache dropped them."""
        entry = self._entry(name)
        if name in self.cpu:
            self.stats.cpu_hits += 1
            self.cpu.move_to_end(name)
            return self.cpu[name]
        self.stats.cpu_misses += 1
        t0 = time.perf_counter()
        weights = self.read(entry.path)
        if weights.digest.value != entry.digest.value:
            raise AdapterConflict("changed_on_disk", f"adapter {name!r} changed on disk since it was loaded; reload it")
        self.insert_cpu(name, weights)
        self.stats.record_load("disk", time.perf_counter() - t0)
        return weights

    def _evict_cpu(self, keep: str) -> None:
        excess = len(self.cpu) - self.engine.max_cpu_loras
        for name in list(self.cpu):
            if excess <= 0:
                break
            entry = self.entries.get(name)
            if name == keep or entry is not None and (entry.pinned or entry.in_flight or entry.slot is not None):
                continue
            del self.cpu[name]
            self.stats.cpu_evictions += 1
            excess -= 1

    # -- GPU tier ------------------------------------------------------------------------------
    def activate(self, names: Iterable[str], protected: set[str]) -> dict[str, int]:
        """GPU slots for this step's adapters, copying in the missing ones.

        `protected` are adapters the running batch uses: never evicted to make room.
        """
        names = list(names)
        keep = protected | set(names)
        result: dict[str, int] = {}
        for name in names:
            result[name] = self._ensure_slot(name, keep)
        if self.slots is not None:
            self.slots.wait(list(result.values()))
        return result

    def prefetch(self, names: Iterable[str], protected: set[str]) -> list[str]:
        """Best effort: copy waiting requests' adapters into free or evictable slots ahead of time."""
        done = []
        for name in names:
            entry = self.entries.get(name)
            if entry is None or entry.removed or entry.slot is not None or name not in self.cpu:
                continue
            keep = protected | set(done)  # never evict what this call just prefetched
            if self._free_slot(keep, allow_pinned=False) is None:
                break
            self._ensure_slot(name, keep, allow_pinned=False)
            done.append(name)
        return done

    def _free_slot(self, protected: set[str], allow_pinned: bool) -> int | None:
        """A slot to use: free, else the least recently used one outside `protected`, preferring
        adapters with nothing in flight, and taking a pinned adapter's slot only if `allow_pinned`
        (pinning keeps an adapter in the CPU cache for good; its GPU slot is given up when a batch
        needs it, since the scheduler admits up to `max_loras` adapters regardless of pins)."""
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                return slot
        tiers = [lambda e: not e.pinned and e.in_flight == 0, lambda e: not e.pinned]
        if allow_pinned:
            tiers.append(lambda e: True)
        for acceptable in tiers:
            for owner in self._gpu_lru:
                entry = self.entries[owner]
                if owner not in protected and acceptable(entry):
                    return entry.slot
        return None

    def _ensure_slot(self, name: str, protected: set[str], allow_pinned: bool = True) -> int:
        entry = self._entry(name)
        if entry.slot is not None:
            self.stats.gpu_hits += 1
            self._gpu_lru.move_to_end(name)
            return entry.slot
        self.stats.gpu_misses += 1
        weights = self.ensure_cpu(name)
        slot = self._free_slot(protected, allow_pinned)
        if slot is None:
            raise RuntimeError(f"no GPU slot for adapter {name!r}: all {len(self._slot_owner)} are protected")
        self._vacate(slot)
        t0 = time.perf_counter()
        if self.slots is not None:
            self.slots.fill(slot, weights)
        if weights.packed is not None:
            weights.packed.release_gpu()  # in the slot now: the slot is the GPU copy
        self.stats.record_load("cpu", time.perf_counter() - t0)
        self._slot_owner[slot] = name
        entry.slot = slot
        self._gpu_lru[name] = None
        return slot

    def _vacate(self, slot: int, evicted: bool = True) -> None:
        owner = self._slot_owner[slot]
        if owner is None:
            return
        self.entries[owner].slot = None
        self._gpu_lru.pop(owner, None)
        self._slot_owner[slot] = None
        self.stats.gpu_evictions += int(evicted)
        if self.slots is not None:
            self.slots.clear(slot)

    def gpu_resident(self) -> list[str]:
        return list(self._gpu_lru)

    def offload(self, name: str) -> None:
        """Free `name`'s GPU slot, if it has one; it stays registered (and on the CPU tier)."""
        entry = self._entry(name)
        if entry.slot is not None:
            self._vacate(entry.slot, evicted=False)

    def _drop(self, name: str) -> None:
        entry = self.entries[name]
        if entry.slot is not None:
            self._vacate(entry.slot, evicted=False)  # an unload, not an eviction
        del self.entries[name]
        self.cpu.pop(name, None)

    def _prepare(self, weights: LoraWeights) -> None:
        """Keep only the slot-layout copy: `read` made it; weights built elsewhere are packed here."""
        packed = weights.packed
        if (packed is None or packed.dtype != self.dtype or packed.pinned != self._pin
                or packed.ranks.shape[0] != self.model.num_layers):
            packed = weights.packed = pack_weights(weights, self.model.num_layers, self.dtype, self._pin)
        if weights.dora and weights.dora_scale is None:  # before the adapter's own tensors go
            weights.dora_scale = (self.loop_dora(weights) if self.loop_dora is not None
                                  else prepare_dora(weights, self.model, self.base_weight, self._pin))
        weights.modules = packed.views  # the originals (file mapping, unpinned tensors) go


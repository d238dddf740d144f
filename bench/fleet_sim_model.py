"""Fleet simulator, the model: the router's own scheduling policies on simulated vLLM-like replicas.

Deterministic discrete-event simulation in virtual time (seeded). Every routing decision is made by
`lorafleet.router.scheduling.policies` — the objects the gateway runs — on `EndpointView`s built
from the simulated replicas; only the replicas are modelled here.

Replica model (vLLM-like, per replica):
- CPU adapter cache of `cpu_slots` (LRU), GPU slots `gpu_slots` (LRU, a subset of the CPU cache).
- A request for an adapter absent from the CPU cache triggers a disk load (`disk_load_ms`; counted
  as a *cold load*); concurrent requests for it wait for the same load.
- Continuous batching: at each step start, waiting requests are admitted first-come-first-served
  while fewer than `max_batch` run and the batch's distinct adapters fit `gpu_slots` (vLLM's
  max_loras; a request whose adapter cannot get a slot is skipped, i.e. *deferred*). An adapter
  entering a GPU slot adds `cpu_to_gpu_ms` to that step.
- Step time = `step_base_ms + step_per_seq_ms × batch + prefill_ms × newly admitted`. Defaults are
  assumptions for the seed's 7.8B model on one H200 (decode step ≈ 25 ms at batch 64, ≈ 10 ms for a
  ~512-token prefill), not measurements: the CPU demo worker is not representative. Pass measured
  numbers with the flags to re-run with your hardware's step times.
- Time-to-first-token = arrival → end of the step that ran the request's prefill.

The router's explicit unloads (cache admission of the `lorafleet` policy) are applied at once; the
unload-when-idle of a non-admitted adapter happens when its last request on that replica finishes.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from lorafleet.router.scheduling.fleet_index import FleetIndex
from lorafleet.router.scheduling.indexed import IndexedPolicy
from lorafleet.router.scheduling.policies import Policy
from lorafleet.router.scheduling.types import EndpointView, RequestInfo

BASE = "base"


@dataclass(frozen=True, slots=True)
class SimConfig:
    replicas: int = 8
    gpu_slots: int = 16
    cpu_slots: int = 64
    adapters: int = 1000
    zipf: float = 1.1
    requests: int = 40_000
    warmup_fraction: float = 0.25
    max_batch: int = 64
    mean_output_tokens: int = 128
    step_base_ms: float = 10.0
    step_per_seq_ms: float = 15.0 / 64
    prefill_ms: float = 10.0
    cpu_to_gpu_ms: float = 5.0
    disk_load_ms: float = 50.0
    seed: int = 1

    def step_ms(self, batch: int, new: int, gpu_loads: int) -> float:
        return (
            self.step_base_ms
            + self.step_per_seq_ms * batch
            + self.prefill_ms * new
            + self.cpu_to_gpu_ms * gpu_loads
        )

    def capacity_rps(self) -> float:
        """Ideal fleet throughput: full batches, no adapter costs (what "% load" is relative to)."""
        per_request_s = self.mean_output_tokens * self.step_ms(self.max_batch, 0, 0) / 1000 / self.max_batch
        per_request_s += self.prefill_ms / 1000
        return self.replicas / per_request_s


@dataclass(slots=True)
class Req:
    rid: int
    t_arrival: float
    adapter: str
    out_tokens: int
    replica: int = -1
    t_first: float = math.nan
    finish_step: int = 0


@dataclass(slots=True)
class Replica:
    name: str
    cfg: SimConfig
    ident: int = -1  # position in the fleet (and id in the FleetIndex)
    cpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loading: dict[str, list[Req]] = field(default_factory=dict)
    waiting: deque[Req] = field(default_factory=deque)
    running: dict[int, Req] = field(default_factory=dict)
    finish: list[tuple[int, int]] = field(default_factory=list)
    admitted_this_step: list[Req] = field(default_factory=list)
    in_system: Counter[str] = field(default_factory=Counter)  # assigned, not finished
    active: Counter[str] = field(default_factory=Counter)  # running
    transient: set[str] = field(default_factory=set)
    queued: Counter[str] = field(default_factory=Counter)  # requests in `waiting` per adapter
    held: int = 0  # requests waiting for a load under way
    step_no: int = 0
    busy: bool = False
    served: int = 0

    def view(self) -> EndpointView:
        """The replica as the gateway's poll would show it (the O(replicas) path builds one per replica
        per decision; the indexed path keeps a `FleetIndex` in step instead, see `Simulation`)."""
        held = sum(len(v) for v in self.loading.values())
        queued = Counter(r.adapter for r in self.waiting)
        return EndpointView(
            name=self.name,
            model=BASE,
            gpu=frozenset(self.gpu),
            cpu=frozenset(self.cpu),  # includes adapters being loaded: requests join that load
            active=frozenset(self.active),
            waiting_adapters=frozenset(queued) | frozenset(self.loading),
            running=len(self.running),
            waiting=len(self.waiting) + held,
            inflight=len(self.running) + len(self.waiting) + held,
            max_loras=self.cfg.gpu_slots,
            max_cpu_loras=self.cfg.cpu_slots,
            capacity=self.cfg.max_batch,
        )

    def evict_cpu(self, adapter: str) -> None:
        self.cpu.pop(adapter, None)
        self.gpu.pop(adapter, None)
        self.transient.discard(adapter)

    def make_cpu_room(self) -> list[str]:
        """Worker-side LRU eviction (skips adapters with requests assigned); returns the evicted."""
        evicted = []
        while len(self.cpu) >= self.cfg.cpu_slots:
            victim = next((a for a in self.cpu if self.in_system[a] == 0), None)
            if victim is None:
                break  # everything busy: over-commit briefly, as a real worker would queue
            self.evict_cpu(victim)
            evicted.append(victim)
        return evicted


class Simulation:
    """Runs a trace through the replicas. A lorafleet-shaped policy decides on a `FleetIndex` the
    simulation keeps in step with every replica change (as the gateway's fleet does), the others on
    a fresh `EndpointView` per replica per request. `check_index`: assert at every decision that the
    index shows what the views show (tests)."""

    def __init__(self, cfg: SimConfig, policy: Policy, load: float, check_index: bool = False) -> None:
        self.cfg = cfg
        self.policy = policy
        self.load = load
        self.replicas = [Replica(f"r{i}", cfg, i) for i in range(cfg.replicas)]
        # check_index: the same policy, unused so far, run the plain way beside the indexed one
        self.reference = copy.deepcopy(policy) if check_index else None
        self.index: FleetIndex | None = None
        self.indexed: IndexedPolicy | None = None
        try:
            self.indexed = IndexedPolicy.of(policy)
        except ValueError:
            pass
        if self.indexed is not None:
            self.index = FleetIndex()
            for rep in self.replicas:
                self.index.upsert(
                    rep.name, BASE, max_loras=cfg.gpu_slots, max_cpu_loras=cfg.cpu_slots, capacity=cfg.max_batch
                )
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self.cold_loads = 0
        self.cold_loads_measured = 0
        self.reasons: Counter[str] = Counter()
        self.deferrals = 0
        self.cold_kinds: Counter[str] = Counter()

    # ---- keeping the index in step (no-ops for the policies that read views) ----------------------
    def _tier(self, idx: int, adapter: str) -> None:
        if self.index is not None:
            rep = self.replicas[idx]
            tier = "gpu" if adapter in rep.gpu else "cpu" if adapter in rep.cpu else None
            self.index.set_tier(idx, adapter, tier)

    def _flags(self, idx: int, adapter: str) -> None:
        if self.index is not None:
            rep = self.replicas[idx]
            self.index.set_active(idx, adapter, rep.active[adapter] > 0)
            self.index.set_waiting_adapter(idx, adapter, rep.queued[adapter] > 0 or adapter in rep.loading)

    def _counts(self, idx: int) -> None:
        if self.index is not None:
            rep = self.replicas[idx]
            queued = len(rep.waiting) + rep.held
            self.index.set_counts(idx, len(rep.running), queued, len(rep.running) + queued)

    def _evict(self, idx: int, adapter: str) -> None:
        self.replicas[idx].evict_cpu(adapter)
        self._tier(idx, adapter)

    def push(self, t: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    def run(self, trace: list[Req]) -> dict[str, float]:
        warm = int(len(trace) * self.cfg.warmup_fraction)
        for req in trace:
            self.push(req.t_arrival, "arrive", req)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(t, payload, measured=payload.rid >= warm)  # type: ignore[union-attr]
            elif kind == "loaded":
                self.loaded(t, *payload)  # type: ignore[misc]
            else:
                self.step_end(t, payload)  # type: ignore[arg-type]
        measured = trace[warm:]
        ttft = np.array([r.t_first - r.t_arrival for r in measured]) * 1000
        served = np.array([r.served for r in self.replicas], dtype=float)
        per_replica = Counter(r.replica for r in measured)
        counts = np.array([per_replica.get(i, 0) for i in range(self.cfg.replicas)], dtype=float)
        return {
            "cold_loads_per_1k": 1000 * self.cold_loads_measured / len(measured),
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "load_imbalance_max_over_mean": float(counts.max() / counts.mean()),
            "deferrals_per_1k": 1000 * self.deferrals / len(trace),
            "hot_share": self.reasons["hot"] / len(trace),
            "warm_share": self.reasons["warm"] / len(trace),
            "cold_share": self.reasons["cold"] / len(trace),
            "served_total": float(served.sum()),
            "cold_spill_per_1k": 1000 * self.cold_kinds["spill"] / len(measured),
            "cold_absent_per_1k": 1000 * self.cold_kinds["absent"] / len(measured),
            "virtual_s": float(max(r.t_first for r in trace)),
            "last_arrival_s": trace[-1].t_arrival,
        }

    def decide(self, req: Req):
        info = RequestInfo(BASE, (req.adapter,))
        if self.indexed is None:
            return self.policy.schedule(info, [r.view() for r in self.replicas])
        assert self.index is not None
        decision = self.indexed.schedule(info, self.index)
        if self.reference is not None:
            views = [r.view() for r in self.replicas]
            assert self.index.views() == views, "the index and the replicas disagree"
            want = self.reference.schedule(info, views)
            assert (decision.endpoint, decision.reason, decision.needs_load, decision.admission) == (
                want.endpoint, want.reason, want.needs_load, want.admission
            ), "the indexed decision differs from Policy.schedule's"
        return decision

    def arrive(self, t: float, req: Req, measured: bool) -> None:
        decision = self.decide(req)
        self.reasons[decision.reason] += 1
        idx = int(decision.endpoint.name[1:])
        rep = self.replicas[idx]
        req.replica = idx
        for victim in decision.admission.unload_before:
            if rep.in_system[victim] == 0:
                self._evict(idx, victim)
        rep.in_system[req.adapter] += 1
        a = req.adapter
        if a in rep.loading:
            rep.loading[a].append(req)
            rep.held += 1
            self._counts(idx)
            return
        if a in rep.cpu:
            rep.cpu.move_to_end(a)
            rep.waiting.append(req)
            rep.queued[a] += 1
            self._flags(idx, a)
            self._counts(idx)
            self.kick(t, rep)
            return
        self.cold_loads += 1
        self.cold_loads_measured += measured
        if measured:
            if self.index is not None:
                elsewhere = bool(self.index.holders.get(a))
            else:
                elsewhere = any(a in r.cpu for r in self.replicas)
            self.cold_kinds["spill" if elsewhere else "absent"] += 1
        for victim in rep.make_cpu_room():
            self._tier(idx, victim)
        rep.cpu[a] = None
        self._tier(idx, a)
        if decision.needs_load and not decision.admission.admit:
            rep.transient.add(a)
        rep.loading[a] = [req]
        rep.held += 1
        self._flags(idx, a)
        self._counts(idx)
        self.push(t + self.cfg.disk_load_ms / 1000, "loaded", (idx, a))

    def loaded(self, t: float, idx: int, adapter: str) -> None:
        rep = self.replicas[idx]
        reqs = rep.loading.pop(adapter)
        rep.waiting.extend(reqs)
        rep.held -= len(reqs)
        rep.queued[adapter] += len(reqs)
        self._flags(idx, adapter)
        self._counts(idx)
        self.kick(t, rep)

    def kick(self, t: float, rep: Replica) -> None:
        if not rep.busy:
            self.step_start(t, rep)

    def step_start(self, t: float, rep: Replica) -> None:
        cfg = self.cfg
        admitted: list[Req] = []
        gpu_loads = 0
        skipped: deque[Req] = deque()
        while rep.waiting and len(rep.running) + len(admitted) < cfg.max_batch:
            req = rep.waiting.popleft()
            a = req.adapter
            if rep.active[a] == 0 and len(rep.active) >= cfg.gpu_slots:
                skipped.append(req)
                self.deferrals += 1
                if len(skipped) > 256:
                    break
                continue
            if a not in rep.gpu:
                gpu_loads += 1
                while len(rep.gpu) >= cfg.gpu_slots:
                    victim = next((x for x in rep.gpu if rep.active[x] == 0), None)
                    if victim is None:
                        break
                    del rep.gpu[victim]
                    self._tier(rep.ident, victim)
                rep.gpu[a] = None
                self._tier(rep.ident, a)
            rep.gpu.move_to_end(a)
            rep.active[a] += 1
            rep.queued[a] -= 1
            admitted.append(req)
        skipped.extend(rep.waiting)
        rep.waiting = skipped
        for req in admitted:
            rep.running[req.rid] = req
        if self.index is not None:
            for a in {req.adapter for req in admitted}:
                self._flags(rep.ident, a)
            self._counts(rep.ident)
        if not admitted and not rep.running:
            rep.busy = False
            return
        rep.admitted_this_step = admitted
        rep.busy = True
        dt = cfg.step_ms(len(rep.running), len(admitted), gpu_loads) / 1000
        self.push(t + dt, "step", rep)

    def step_end(self, t: float, rep: Replica) -> None:
        rep.step_no += 1
        for req in rep.admitted_this_step:
            req.t_first = t
            req.finish_step = rep.step_no + req.out_tokens - 1
            heapq.heappush(rep.finish, (req.finish_step, req.rid))
        rep.admitted_this_step = []
        while rep.finish and rep.finish[0][0] <= rep.step_no:
            _, rid = heapq.heappop(rep.finish)
            req = rep.running.pop(rid)
            rep.served += 1
            a = req.adapter
            rep.active[a] -= 1
            if rep.active[a] == 0:
                del rep.active[a]
                self._flags(rep.ident, a)
            rep.in_system[a] -= 1
            if rep.in_system[a] == 0:
                del rep.in_system[a]
                if a in rep.transient:
                    self._evict(rep.ident, a)
        self.step_start(t, rep)

"""Fleet simulator: the router's own scheduling policies on simulated vLLM-like replicas.

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

Usage: python bench/fleet_sim.py [--requests N] [--out bench/results/fleet_sim.json] [--plot PNG]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lorafleet.router.scheduling.policies import POLICIES, Policy
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
    step_no: int = 0
    busy: bool = False
    served: int = 0

    def view(self) -> EndpointView:
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

    def make_cpu_room(self) -> None:
        """Worker-side LRU eviction (skips adapters with requests assigned)."""
        while len(self.cpu) >= self.cfg.cpu_slots:
            victim = next((a for a in self.cpu if self.in_system[a] == 0), None)
            if victim is None:
                return  # everything busy: over-commit briefly, as a real worker would queue
            self.evict_cpu(victim)


class Simulation:
    def __init__(self, cfg: SimConfig, policy: Policy, load: float) -> None:
        self.cfg = cfg
        self.policy = policy
        self.load = load
        self.replicas = [Replica(f"r{i}", cfg) for i in range(cfg.replicas)]
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self.cold_loads = 0
        self.cold_loads_measured = 0
        self.reasons: Counter[str] = Counter()
        self.deferrals = 0
        self.cold_kinds: Counter[str] = Counter()

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

    def arrive(self, t: float, req: Req, measured: bool) -> None:
        decision = self.policy.schedule(RequestInfo(BASE, (req.adapter,)), [r.view() for r in self.replicas])
        self.reasons[decision.reason] += 1
        idx = int(decision.endpoint.name[1:])
        rep = self.replicas[idx]
        req.replica = idx
        for victim in decision.admission.unload_before:
            if rep.in_system[victim] == 0:
                rep.evict_cpu(victim)
        rep.in_system[req.adapter] += 1
        a = req.adapter
        if a in rep.loading:
            rep.loading[a].append(req)
            return
        if a in rep.cpu:
            rep.cpu.move_to_end(a)
            rep.waiting.append(req)
            self.kick(t, rep)
            return
        self.cold_loads += 1
        self.cold_loads_measured += measured
        if measured:
            elsewhere = any(a in r.cpu for r in self.replicas)
            self.cold_kinds["spill" if elsewhere else "absent"] += 1
        rep.make_cpu_room()
        rep.cpu[a] = None
        if decision.needs_load and not decision.admission.admit:
            rep.transient.add(a)
        rep.loading[a] = [req]
        self.push(t + self.cfg.disk_load_ms / 1000, "loaded", (idx, a))

    def loaded(self, t: float, idx: int, adapter: str) -> None:
        rep = self.replicas[idx]
        rep.waiting.extend(rep.loading.pop(adapter))
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
                rep.gpu[a] = None
            rep.gpu.move_to_end(a)
            rep.active[a] += 1
            admitted.append(req)
        skipped.extend(rep.waiting)
        rep.waiting = skipped
        if not admitted and not rep.running:
            rep.busy = False
            return
        for req in admitted:
            rep.running[req.rid] = req
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
            rep.in_system[a] -= 1
            if rep.in_system[a] == 0:
                del rep.in_system[a]
                if a in rep.transient:
                    rep.evict_cpu(a)
        self.step_start(t, rep)


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def make_trace(cfg: SimConfig, rate_rps: float) -> list[Req]:
    rng = np.random.default_rng(cfg.seed)
    probs = zipf_probabilities(cfg.adapters, cfg.zipf)
    # Popularity rank is shuffled onto names so hashing cannot get lucky on name order.
    names = [f"adapter-{i:04d}" for i in rng.permutation(cfg.adapters)]
    ranks = rng.choice(cfg.adapters, size=cfg.requests, p=probs)
    gaps = rng.exponential(1.0 / rate_rps, size=cfg.requests)
    outs = rng.integers(cfg.mean_output_tokens // 4, cfg.mean_output_tokens * 7 // 4 + 1, size=cfg.requests)
    times = np.cumsum(gaps)
    return [Req(i, float(times[i]), names[ranks[i]], int(outs[i])) for i in range(cfg.requests)]


def offline_floor_per_1k(cfg: SimConfig, trace: list[Req]) -> tuple[float, float]:
    """Requests for adapters beyond the fleet's combined CPU capacity (top ones held once each).

    Returns (analytic from the Zipf law, empirical over the measured part of the trace).
    """
    capacity = cfg.replicas * cfg.cpu_slots
    probs = zipf_probabilities(cfg.adapters, cfg.zipf)
    analytic = 1000 * float(probs[capacity:].sum())
    measured = trace[int(len(trace) * cfg.warmup_fraction) :]
    top = {name for name, _ in Counter(r.adapter for r in trace).most_common(capacity)}
    empirical = 1000 * sum(r.adapter not in top for r in measured) / len(measured)
    return analytic, empirical


def run_all(cfg: SimConfig, loads: list[float], policies: list[str]) -> dict:
    capacity = cfg.capacity_rps()
    results: dict = {"config": asdict(cfg), "capacity_rps": capacity, "runs": []}
    for load in loads:
        trace0 = make_trace(cfg, load * capacity)
        floor_analytic, floor_empirical = offline_floor_per_1k(cfg, trace0)
        for name in policies:
            trace = make_trace(cfg, load * capacity)  # fresh request objects, identical content
            started = time.perf_counter()
            metrics = Simulation(cfg, POLICIES[name](), load).run(trace)
            metrics.update(
                policy=name,
                load=load,
                offered_rps=load * capacity,
                floor_per_1k=floor_empirical,
                floor_analytic_per_1k=floor_analytic,
                wall_s=time.perf_counter() - started,
            )
            results["runs"].append(metrics)
            print(
                f"load {load:.0%} {name:>18}: cold/1k {metrics['cold_loads_per_1k']:6.1f} "
                f"(floor {floor_empirical:5.1f})  TTFT p50 {metrics['ttft_p50_ms']:7.1f} ms "
                f"p99 {metrics['ttft_p99_ms']:8.1f} ms  imbalance {metrics['load_imbalance_max_over_mean']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    results["verdicts"] = verdicts(results["runs"])
    return results


def verdicts(runs: list[dict]) -> list[dict]:
    out = []
    for load in sorted({r["load"] for r in runs}):
        at = [r for r in runs if r["load"] == load]
        ours = next(r for r in at if r["policy"] == "lorafleet")
        others = [r for r in at if r["policy"] != "lorafleet"]
        best_cold = min(r["cold_loads_per_1k"] for r in others)
        best_p99 = min(r["ttft_p99_ms"] for r in others)
        out.append(
            {
                "load": load,
                "cold_per_1k": ours["cold_loads_per_1k"],
                "floor_per_1k": ours["floor_per_1k"],
                "cold_over_floor": ours["cold_loads_per_1k"] / ours["floor_per_1k"],
                "cold_target_met": ours["cold_loads_per_1k"] <= 1.5 * ours["floor_per_1k"],
                "cold_over_best_other": ours["cold_loads_per_1k"] / best_cold,
                "ttft_p99_ms": ours["ttft_p99_ms"],
                "best_other_ttft_p99_ms": best_p99,
                "ttft_target_met": ours["ttft_p99_ms"] <= best_p99,
            }
        )
    return out


def table(results: dict) -> str:
    lines = [
        "| load | policy | cold loads / 1k | floor / 1k | TTFT p50 (ms) | TTFT p99 (ms) | imbalance (max/mean) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['load']:.0%} | {r['policy']} | {r['cold_loads_per_1k']:.1f} | {r['floor_per_1k']:.1f} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['load_imbalance_max_over_mean']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)
        return False
    runs = results["runs"]
    loads = sorted({r["load"] for r in runs})
    names = list(dict.fromkeys(r["policy"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("cold_loads_per_1k", "cold loads per 1k requests"),
        ("ttft_p99_ms", "p99 time to first token (ms, log)"),
        ("load_imbalance_max_over_mean", "load imbalance (max/mean requests)"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for name in names:
            ys = [next(r[key] for r in runs if r["policy"] == name and r["load"] == load) for load in loads]
            ax.plot(
                [f"{x:.0%}" for x in loads],
                ys,
                marker="o",
                label=name,
                linewidth=2.5 if name == "lorafleet" else 1.2,
            )
        if key == "cold_loads_per_1k":
            floors = [next(r["floor_per_1k"] for r in runs if r["load"] == load) for load in loads]
            ax.plot([f"{x:.0%}" for x in loads], floors, "k--", label="offline floor")
        if key == "ttft_p99_ms":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("offered load (share of fleet capacity)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(
        f"fleet_sim: {cfg['replicas']} replicas × ({cfg['gpu_slots']} GPU, {cfg['cpu_slots']} CPU slots), "
        f"{cfg['adapters']} adapters Zipf {cfg['zipf']}, {cfg['requests']} requests/run"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    defaults = SimConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in defaults.__dataclass_fields__:
        value = getattr(defaults, f)
        p.add_argument(f"--{f.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--loads", default="0.5,0.7,0.9")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", type=Path, default=Path("bench/results/fleet_sim.json"))
    p.add_argument("--plot", type=Path, default=Path("docs/fleet_sim.png"))
    args = p.parse_args(argv)
    cfg = SimConfig(**{f: getattr(args, f) for f in defaults.__dataclass_fields__})
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    if "lorafleet" not in policies:
        policies.insert(0, "lorafleet")
    results = run_all(cfg, loads, policies)
    print(
        f"capacity {results['capacity_rps']:.1f} req/s; offline floor = share of requests beyond the top "
        f"{cfg.replicas * cfg.cpu_slots} adapters"
    )
    print(table(results))
    for v in results["verdicts"]:
        print(
            f"load {v['load']:.0%}: cold {v['cold_per_1k']:.1f}/1k = {v['cold_over_floor']:.2f}× floor "
            f"({'met' if v['cold_target_met'] else 'MISSED'} ≤1.5×), {v['cold_over_best_other']:.2f}× best other; "
            f"p99 TTFT {v['ttft_p99_ms']:.0f} ms vs best other {v['best_other_ttft_p99_ms']:.0f} ms "
            f"({'met' if v['ttft_target_met'] else 'MISSED'})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

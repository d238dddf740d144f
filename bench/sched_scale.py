"""Decision cost of the router's own policy at fleet scale: the indexed path against the plain one.

For each size (replicas × adapters) a fleet is built as our placement leaves it: adapters in
popularity order, each with copies in proportion to its demand (at least one) on its first
rendezvous replicas that have room, until every replica holds `--cpu` adapters; the `--gpu` most
popular of them are in GPU slots, some of those running; queue depths are random. Requests follow
Zipf(`--zipf`) over the adapters. Between decisions the view changes as in service: the chosen
replica gets the request (running count, adapter active, a cold adapter loaded there with the
admission's unloads), a random replica finishes one, and every 10 decisions a random replica loads
one adapter and evicts another.

Timed: `IndexedPolicy.schedule` on the `FleetIndex` (decision), the index updates after it
(update), and, on fewer decisions, the plain path the gateway ran before the index (`EndpointView`s
of every replica, then `Policy.schedule`): the ratio of the two in the same run is the figure that
holds on a shared machine. Each size is repeated `--repeats` times on one fleet and one policy (as a
router that keeps serving); the table shows medians and the best run's p99, the JSON every run with
its cost per path (cold: no replica holds the adapter; drawn: more than `--holder-sample` do;
holders: the rest), the machine's load average and the CPUs the process may run on.

Usage: python bench/sched_scale.py [--sizes 8x1000,64x10000,256x50000,1024x100000] [--decisions 10000]
       [--repeats 3] [--holder-sample 8] [--out bench/results/sched_scale.json]
       (pin it to one core to keep it from migrating: taskset -c 1 python bench/sched_scale.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lorafleet.router.scheduling.fleet_index import FleetIndex
from lorafleet.router.scheduling.indexed import IndexedPolicy
from lorafleet.router.scheduling.policies import lorafleet_policy
from lorafleet.router.scheduling.types import RequestInfo

TARGET_P99_US = 100.0


@dataclass(frozen=True, slots=True)
class Size:
    replicas: int
    adapters: int


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def build_fleet(size: Size, cpu: int, gpu: int, zipf: float, rng: np.random.Generator) -> tuple[FleetIndex, list[str], np.ndarray]:
    """A fleet as demand-proportional rendezvous placement leaves it (see the module docstring)."""
    index = FleetIndex()
    for r in range(size.replicas):
        index.upsert(f"replica-{r:04d}", max_loras=gpu, max_cpu_loras=cpu, capacity=64)
    names = [f"adapter-{i:06d}" for i in rng.permutation(size.adapters)]  # popularity rank -> name
    probs = zipf_probabilities(size.adapters, zipf)
    free = [cpu] * size.replicas
    left = size.replicas * cpu
    for rank, name in enumerate(names):
        if left == 0:
            break
        copies = max(1, round(float(probs[rank]) * size.replicas))
        for i in index.ring.walk(name):
            if free[i]:
                index.set_tier(i, name, "gpu" if cpu - free[i] < gpu else "cpu")  # most popular first
                free[i] -= 1
                left -= 1
                copies -= 1
                if copies == 0 or left == 0:
                    break
    for i, r in enumerate(index.replicas):
        running = int(rng.integers(0, 65))
        waiting = int(rng.integers(0, 9))
        index.set_counts(i, running, waiting, running + waiting)
        on_gpu = sorted(r.gpu)
        for a in rng.choice(on_gpu, size=min(len(on_gpu), int(rng.integers(0, gpu + 1))), replace=False):
            index.set_active(i, str(a), True)
        if rng.random() < 0.3 and r.resident:
            index.set_waiting_adapter(i, str(rng.choice(sorted(r.resident))), True)
    return index, names, probs


@dataclass(slots=True)
class Changes:
    """What happens in the fleet after one decision (drawn untimed; only applying it is timed)."""

    finisher: int  # replica where a request finishes
    deactivate: bool  # ... and one of its adapters goes idle
    evict: tuple[int, str | None, str] | None  # every 10 decisions: (replica, evicted, loaded)


def draw_changes(index: FleetIndex, rng: np.random.Generator, loads: list[str], step: int) -> Changes:
    evict = None
    if step % 10 == 0:
        j = int(rng.integers(len(index.replicas)))
        f = index.replicas[j]
        idle = sorted(a for a in f.resident if a not in f.active)
        victim = idle[int(rng.integers(len(idle)))] if idle else None
        evict = (j, victim, loads[step // 10])
    return Changes(int(rng.integers(len(index.replicas))), bool(rng.random() < 0.3), evict)


def apply(index: FleetIndex, decision, adapter: str, changes: Changes) -> None:
    """The view's changes after a decision, as the gateway and the workers would report them."""
    i = index.ids[decision.endpoint.name]
    r = index.replicas[i]
    for victim in decision.admission.unload_before:
        index.set_tier(i, victim, None)
    if decision.needs_load:
        index.set_tier(i, adapter, "cpu")
    index.set_counts(i, r.running + 1, r.waiting, r.inflight + 1)
    index.set_active(i, adapter, True)
    f = index.replicas[changes.finisher]
    if f.running > 0:
        index.set_counts(changes.finisher, f.running - 1, f.waiting, max(0, f.inflight - 1))
        if f.active and changes.deactivate:
            index.set_active(changes.finisher, next(iter(f.active)), False)
    if changes.evict is not None:
        j, victim, loaded = changes.evict
        if victim is not None:
            index.set_tier(j, victim, None)
        index.set_tier(j, loaded, "cpu")


def percentiles(ns: list[int]) -> tuple[float, float]:
    a = np.array(ns, dtype=np.float64) / 1000
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run_size(size: Size, args: argparse.Namespace, seed: int) -> list[dict]:
    """`args.repeats` runs on one fleet (built once: the placement walk is the slow part) and one
    policy, each with a fresh request stream, fleet and policy carrying on from the previous run as
    in a router that keeps serving. The first run also pays for what a router builds once (every
    replica's popularity heap and every slot's group ranking, at the first cold decision, in the
    warm-up)."""
    rng = np.random.default_rng(seed)
    index, names, probs = build_fleet(size, args.cpu, args.gpu, args.zipf, rng)
    policy = IndexedPolicy.of(lorafleet_policy(holder_sample=args.holder_sample))
    return [run_once(index, policy, names, probs, size, args, rng) for _ in range(args.repeats)]


def run_once(
    index: FleetIndex, policy: IndexedPolicy, names: list[str], probs: np.ndarray, size: Size,
    args: argparse.Namespace, rng: np.random.Generator,
) -> dict:
    total = args.warmup + args.decisions
    ranks = rng.choice(size.adapters, size=total, p=probs)
    reqs = [RequestInfo("base", (names[r],)) for r in ranks]
    loads = [names[r] for r in rng.choice(size.adapters, size=total // 10 + 1, p=probs)]
    reasons: list[str] = []
    kinds: list[str] = []  # the decision's path: cold (no holder), drawn (k of many holders), holders
    k = policy.policy.holder_sample
    decide_ns: list[int] = []
    update_ns: list[int] = []
    gc.collect()
    gc.freeze()  # the fleet is long-lived, as in a router process: keep it out of the collector's scans
    # CPU time of this thread: on a shared machine the wall clock also counts the time the scheduler
    # gave other processes; both are reported.
    clock = time.thread_time_ns
    wall = time.perf_counter_ns
    wall_ns: list[int] = []
    for step, req in enumerate(reqs):
        changes = draw_changes(index, rng, loads, step)
        held = len(index.holders.get(req.adapters[0], ()))
        w0 = wall()
        t0 = clock()
        d = policy.schedule(req, index)
        t1 = clock()
        w1 = wall()
        apply(index, d, req.adapters[0], changes)
        t2 = clock()
        if step >= args.warmup:
            decide_ns.append(t1 - t0)
            update_ns.append(t2 - t1)
            wall_ns.append(w1 - w0)
            reasons.append(d.reason)
            kinds.append("cold" if not held else "drawn" if k is not None and held > k else "holders")
    plain_ns: list[int] = []
    plain = lorafleet_policy(holder_sample=args.holder_sample)
    for req in reqs[: args.plain_decisions]:  # what the gateway did per request: views, then the policy
        t0 = clock()
        plain.schedule(req, index.views())
        plain_ns.append(clock() - t0)
    gc.unfreeze()
    d50, d99 = percentiles(decide_ns)
    _, u99 = percentiles(update_ns)
    _, t99 = percentiles([a + b for a, b in zip(decide_ns, update_ns, strict=True)])
    p50, p99 = percentiles(plain_ns)
    w50, w99 = percentiles(wall_ns)
    holders = [len(index.holders.get(names[0], ()))]  # names[0] is the most popular adapter
    both = [a + b for a, b in zip(decide_ns, update_ns, strict=True)]
    by_kind = {}
    for kind in ("cold", "drawn", "holders"):
        sel = [t for t, x in zip(both, kinds, strict=True) if x == kind]
        if sel:
            k50, k99 = percentiles(sel)
            by_kind[kind] = {"share": len(sel) / len(both), "p50_us": k50, "p99_us": k99}
    return {
        "decision_p50_us": d50,
        "decision_p99_us": d99,
        "update_p99_us": u99,
        "decision_plus_update_p99_us": t99,
        "decision_wall_p50_us": w50,
        "decision_wall_p99_us": w99,
        "plain_decision_p50_us": p50,
        "plain_decision_p99_us": p99,
        "speedup_p50": p50 / d50,
        "top_adapter_holders": holders[0],
        "cold_share": reasons.count("cold") / len(reasons),
        "decision_plus_update_by_path": by_kind,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8x1000,64x10000,256x50000,1024x100000")
    p.add_argument("--decisions", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=1_000)
    p.add_argument("--plain-decisions", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu", type=int, default=64)
    p.add_argument("--gpu", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--holder-sample", type=int, default=8, help="the policy's holder_sample; 0: score every holder")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/sched_scale.json"))
    p.add_argument("--plot", type=Path, default=Path("docs/sched_scale.png"), help="'' for none")
    args = p.parse_args(argv)
    args.holder_sample = args.holder_sample or None
    sizes = [Size(*map(int, s.split("x"))) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        load_before = os.getloadavg()
        reps = run_size(size, args, args.seed)
        row = {"replicas": size.replicas, "adapters": size.adapters}
        for key in reps[0]:
            if isinstance(reps[0][key], (int, float)):
                row[key] = statistics.median(r[key] for r in reps)
        row["best_repeat_decision_plus_update_p99_us"] = min(r["decision_plus_update_p99_us"] for r in reps)
        row["repeats"] = reps
        row["loadavg_1m"] = [load_before[0], os.getloadavg()[0]]
        rows.append(row)
        print(
            f"{size.replicas:>5} × {size.adapters:>6}: decision p50 {row['decision_p50_us']:6.1f} µs "
            f"p99 {row['decision_p99_us']:6.1f} µs, update p99 {row['update_p99_us']:5.1f} µs; "
            f"plain p50 {row['plain_decision_p50_us']:8.1f} µs ({row['speedup_p50']:.0f}×); "
            f"load {row['loadavg_1m'][0]:.1f}",
            file=sys.stderr,
            flush=True,
        )
    print(table(rows, args))
    print(text_plot(rows))
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "target_p99_us": TARGET_P99_US,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if str(args.plot) not in ("", "."):
        plot(rows, args.plot)
    return 0


def text_plot(rows: list[dict], width: int = 60) -> str:
    """Log-scale bars, for where matplotlib is not installed: µs per decision, plain path against indexed."""
    import math

    top = max(max(r["plain_decision_p50_us"], r["decision_plus_update_p99_us"]) for r in rows)
    scale = width / math.log10(top * 1.01)

    def bar(v: float, ch: str) -> str:
        return ch * max(1, round(math.log10(max(v, 1.0)) * scale))

    lines = [f"µs per decision, log scale (1 … {top:,.0f}); P = plain p50, I = indexed p50, 9 = indexed p99 with updates"]
    for r in rows:
        label = f"{r['replicas']}×{r['adapters'] // 1000}k"
        lines.append(f"{label:>10} P {bar(r['plain_decision_p50_us'], 'P')} {r['plain_decision_p50_us']:,.0f}")
        lines.append(f"{'':>10} I {bar(r['decision_p50_us'], 'I')} {r['decision_p50_us']:,.0f}")
        lines.append(f"{'':>10} 9 {bar(r['decision_plus_update_p99_us'], '9')} {r['decision_plus_update_p99_us']:,.0f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written", file=sys.stderr)
        return False
    xs = [r["replicas"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [r["plain_decision_p50_us"] for r in rows], "s--", label="plain O(replicas) path, p50")
    ax.plot(xs, [r["decision_p50_us"] for r in rows], "o-", label="indexed, p50")
    ax.plot(xs, [r["decision_plus_update_p99_us"] for r in rows], "o:", label="indexed, p99 incl. updates")
    ax.axhline(TARGET_P99_US, color="k", linewidth=0.8, label=f"target p99 {TARGET_P99_US:.0f} µs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{r['replicas']}×{r['adapters'] // 1000}k" for r in rows])
    ax.set_xlabel("replicas × adapters")
    ax.set_ylabel("µs per decision (CPU time)")
    ax.set_title("lorafleet policy decision cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"medians of {args.repeats} runs × {args.decisions} decisions, CPU time of the deciding thread "
        f"(wall clock also shown); Zipf {args.zipf}, "
        f"{args.cpu} CPU / {args.gpu} GPU residents per replica",
        "",
        "| replicas × adapters | decision p50 (µs) | decision p99 (µs) | update p99 (µs) | decision + update p99 (µs) "
        "| best run's decision + update p99 (µs) | wall p50 / p99 (µs) | plain path p50 (µs) | speed-up (p50) "
        "| top adapter's holders | load avg (1 min) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['replicas']} × {r['adapters']} | {r['decision_p50_us']:.1f} | {r['decision_p99_us']:.1f} | "
            f"{r['update_p99_us']:.1f} | {r['decision_plus_update_p99_us']:.1f} | "
            f"{r['best_repeat_decision_plus_update_p99_us']:.1f} | "
            f"{r['decision_wall_p50_us']:.0f} / {r['decision_wall_p99_us']:.0f} | {r['plain_decision_p50_us']:.0f} | "
            f"{r['speedup_p50']:.0f}× | {r['top_adapter_holders']:.0f} | {r['loadavg_1m'][0]:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Fleet simulator: the router's own scheduling policies on simulated vLLM-like replicas.

Deterministic discrete-event simulation in virtual time (fixed seed). Every routing decision is made
by `lorafleet.router.scheduling.policies` — the objects the gateway runs — on `EndpointView`s built
from the simulated replicas; only the replicas are modelled. Modules, in the order data flows:
`fleet_sim_workload` (Zipf/Poisson trace, offline floor) → `fleet_sim_model` (replicas, batching,
costs; the replica model is described there) → this file (runs every policy at every load) →
`fleet_sim_report` (verdicts against the targets, table, plot).

Usage: python bench/fleet_sim.py [--requests N] [--jobs N] [--out bench/results/fleet_sim.json] [--plot PNG]
       [--fleet]  (store the runs under `fleets["<replicas>x<adapters>x<requests>"]` of the existing
       --out file, replacing those of the same policy and load and keeping the rest: larger fleets'
       runs, made policy by policy in separate processes, beside the default run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet_sim_model import SimConfig, Simulation
from bench.fleet_sim_report import plot, table, verdicts
from bench.fleet_sim_workload import make_trace, offline_floor_per_1k
from lorafleet.router.scheduling.policies import POLICIES


def run_one(cfg: SimConfig, load: float, name: str) -> dict:
    """One policy at one load on a fresh trace (identical content for every policy: fixed seed)."""
    capacity = cfg.capacity_rps()
    trace = make_trace(cfg, load * capacity)
    floor_analytic, floor_empirical = offline_floor_per_1k(cfg, trace)
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
    return metrics


def run_all(cfg: SimConfig, loads: list[float], policies: list[str], jobs: int = 1) -> dict:
    """Every (load, policy) pair, in `jobs` worker processes. Runs share no state: the results do not
    depend on `jobs`."""
    results: dict = {"config": asdict(cfg), "capacity_rps": cfg.capacity_rps(), "runs": []}
    pairs = [(load, name) for load in loads for name in policies]
    args = ([cfg] * len(pairs), [load for load, _ in pairs], [name for _, name in pairs])
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for m in pool.map(run_one, *args) if jobs > 1 else map(run_one, *args):
            results["runs"].append(m)
            print(
                f"load {m['load']:.0%} {m['policy']:>18}: cold/1k {m['cold_loads_per_1k']:6.1f} "
                f"(floor {m['floor_per_1k']:5.1f})  TTFT p50 {m['ttft_p50_ms']:7.1f} ms "
                f"p99 {m['ttft_p99_ms']:8.1f} ms  imbalance {m['load_imbalance_max_over_mean']:.2f}  "
                f"({m['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    results["verdicts"] = verdicts(results["runs"])
    return results


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
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="runs in parallel processes")
    p.add_argument("--fleet", action="store_true", help="merge into --out's `fleets` (see the module docstring)")
    args = p.parse_args(argv)
    cfg = SimConfig(**{f: getattr(args, f) for f in defaults.__dataclass_fields__})
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    if "lorafleet" not in policies:
        policies.insert(0, "lorafleet")
    results = run_all(cfg, loads, policies, args.jobs)
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
    if args.fleet:
        results = merge_fleet(json.loads(args.out.read_text()) if args.out.exists() else {}, results, cfg)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "fleets" in previous:
        results["fleets"] = previous["fleets"]
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if str(args.plot) not in ("", "."):  # --plot '': none (Path('') is '.')
        plot(results, args.plot)
    return 0


def merge_fleet(existing: dict, results: dict, cfg: SimConfig) -> dict:
    """`results`' runs into `existing["fleets"][key]` (same policy and load replaced), verdicts redone."""
    key = f"{cfg.replicas}x{cfg.adapters}x{cfg.requests}"
    fleets = existing.setdefault("fleets", {})
    entry = fleets.setdefault(key, {"config": results["config"], "capacity_rps": results["capacity_rps"], "runs": []})
    if entry["config"] != results["config"]:
        raise SystemExit(f"fleet {key}: stored with another configuration; not merged")
    new = {(r["policy"], r["load"]) for r in results["runs"]}
    runs = [r for r in entry["runs"] if (r["policy"], r["load"]) not in new] + results["runs"]
    entry["runs"] = sorted(runs, key=lambda r: (r["load"], r["policy"] != "lorafleet", r["policy"]))
    entry["verdicts"] = verdicts(entry["runs"])
    return existing


if __name__ == "__main__":
    sys.exit(main())

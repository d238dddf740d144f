"""Fleet simulator, the report: verdicts against the targets, the markdown table, the plot."""

from __future__ import annotations

import sys
from pathlib import Path


def verdicts(runs: list[dict]) -> list[dict]:
    out = []
    for load in sorted({r["load"] for r in runs}):
        at = [r for r in runs if r["load"] == load]
        ours = next(r for r in at if r["policy"] == "lorafleet")
        others = [r for r in at if r["policy"] != "lorafleet"]
        if not others:
            continue
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

"""Plot an engine benchmark's throughput against distinct adapters (docs/engine_throughput.png).

    python -m bench.engine_plot [bench/results/engine-h200.json] [--out docs/engine_throughput.png]

One line per (mode, prompt length) from bench/engine.py's rows, the bandwidth ceiling and the
issue's targets (12,000 tokens/s base-only; 0.93x of base with 8 adapters, 0.80x with 64) as
reference lines, and the peers (transformers generate, PEFT's mixed batch) as points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="?", type=Path, default=Path(__file__).parent / "results" / "engine-h200.json")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "docs" / "engine_throughput.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.results.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in data["rows"]:
        series.setdefault((r["mode"], r["prompt_len"]), []).append((r["adapters"], r["tokens_per_s"]))
    for (mode, plen), points in sorted(series.items()):
        xs, ys = zip(*sorted(points))
        ax.plot([max(x, 0.5) for x in xs], ys, marker="o", label=f"lorafleet ({mode}, prompt {plen})")
    ax.axhline(data["ceiling_tokens_per_s"], color="grey", ls="--", lw=1, label="weight-bandwidth ceiling")
    ax.axhline(12000, color="tab:red", ls=":", lw=1, label="target base-only (12,000)")
    ax.plot([8, 64], [0.93 * 12000, 0.80 * 12000], "x", color="tab:red", label="targets 8 / 64 adapters")
    for p in data.get("peers", []):
        if "tokens_per_s" in p:
            ax.plot(max(p["adapters"], 0.5), p["tokens_per_s"], "s", label=f"{p['workload']}")
    ax.set_xscale("log", base=2)
    counts = sorted({r["adapters"] for r in data["rows"] if r["adapters"] > 0})
    ax.set_xticks([0.5, *counts], ["base", *map(str, counts)])
    ax.set_xlabel("distinct rank-16 adapters in a batch of 64")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(0, data["ceiling_tokens_per_s"] * 1.4)
    ax.set_title(f"{data['machine']}, 7.8B seed shape, bf16, {data['date']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A/B of the slot pool's memory layout for the LoRA kernels: rank-major (`[S, r_max, dim]`, each
slot's rows together) against rank-outer (`[r_max, S, dim]`, rank row j of every slot together).

    python -m bench.pool_layout_ab [--out bench/results/pool-layout-h200.json]

The question: a rank-8 adapter in a rank-64 pool runs slower than in a rank-8 pool although the
kernels read the same bytes (issue 3's mixed-rank target). In the rank-major pool those bytes lie
in one block per slot spread over a stack 8x larger; in the rank-outer pool they are the stack's
first eighth, as compact as in a rank-8 pool. Rows: every module, (tokens, adapters) in (64, 8),
(64, 64), (256, 64) at rank 8 in pools of rank 8 and 64, and rank-16 rows in a rank-16 pool (what
the layout costs where the pool rank is the adapters' own), each in both layouts, timed as
`bench/kernels.py` times them (same inputs, CUDA graph over rotating sets).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.kernels import MODULES, Case, measure_copy_bandwidth, run_case

MIXED = [(64, 8), (64, 64), (256, 64)]
SAME_RANK = [(1, 1), (16, 8), (64, 64), (256, 128)]


def cases() -> list[Case]:
    out = []
    for module in MODULES:
        for layout in ("rank_major", "rank_outer"):
            for tokens, adapters in MIXED:
                out += [Case(module, tokens, adapters, 8, pool, b_layout=layout) for pool in (8, 64)]
            out += [Case(module, tokens, adapters, 16, 16, b_layout=layout) for tokens, adapters in SAME_RANK]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/pool-layout-h200.json"))
    args = ap.parse_args()
    bandwidth = measure_copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    rows = []
    for case in cases():
        row = run_case(case, bandwidth, g, baselines=False)
        rows.append(row)
        print(f"{case.module:8s} T={case.tokens:4d} A={case.adapters:4d} r={case.rank:2d} pool={case.pool_rank:2d} "
              f"{case.b_layout:10s} {row['lora_us']:7.2f} µs (no pdl {row.get('no_pdl_us', '-')}) "
              f"err {row['rel_err']:.1e}", flush=True)
    by = {(r["module"], r["tokens"], r["adapters"], r["rank"], r["pool_rank"], r["b_layout"]): r["lora_us"] for r in rows}
    print("\nmixed rank: rank 8 in a rank-64 pool / in a rank-8 pool (target <= 1.15)")
    for module in MODULES:
        for tokens, adapters in MIXED:
            ratios = [by[(module, tokens, adapters, 8, 64, lay)] / by[(module, tokens, adapters, 8, 8, "rank_major")]
                      for lay in ("rank_major", "rank_outer")]
            print(f"{module:8s} {tokens:4d} x {adapters:3d}: rank-major {ratios[0]:.3f}  rank-outer {ratios[1]:.3f}")
    print("\nrank 16 in a rank-16 pool: rank-outer / rank-major")
    for module in MODULES:
        for tokens, adapters in SAME_RANK:
            ratio = by[(module, tokens, adapters, 16, 16, "rank_outer")] / by[(module, tokens, adapters, 16, 16, "rank_major")]
            print(f"{module:8s} {tokens:4d} x {adapters:3d}: {ratio:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bandwidth}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Decode graphs' rank class 8 against 16 for rank-8 adapters in a rank-64 pool (an H200 experiment).

    python -m bench.rank_class_ab [--out bench/results/rank-class-ab-h200.json]

`cuda_graphs.rank_class` starts one-pair steps (as many adapters as tokens) at class 8, so their
row-at-a-time kernels take 8-row rank tiles inside the decode graphs; other steps start at 16. The
engine here has max_lora_rank 64 and rank-8 adapters on all 7 projections; each variant drops the
captured graphs and times async decode at batch 64, prompt 128, as `bench/overlap_sweep.py` does:
"class 8" as the engine runs, "from 16" with every step's class started at 16 (what the graphs
captured before the fourteenth session). Rows: variant, pass, adapters, tok/s, ratio to base-only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.engine_build import build_engine, register_random_adapters
from bench.engine_workload import adapter_sets, decode_run
from lorafleet.worker.engine import cuda_graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", default="64", help="adapter counts besides base-only (always run)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/rank-class-ab-h200.json"))
    args = ap.parse_args()
    counts = sorted({0, *(int(x) for x in args.adapters.split(",") if x)})  # base-only: every ratio's denominator
    batch, prompt_len = 64, 128
    engine, model_config, _ = build_engine(argparse.Namespace(tiny=False, rank=64, batch=batch, modes="async"), "cuda",
                                           max(counts + [1]))
    names = register_random_adapters(engine, model_config, max(counts + [1]), 8)
    decode_run(engine, adapter_sets(names, len(names), batch), 16, 4)  # JIT and allocator
    graphs = engine.runner.graphs
    as_engine = cuda_graphs.rank_class

    def from_16(bound: int, r_max: int, one_pair: bool = True) -> int:
        return as_engine(bound, r_max, False)

    rows = []
    for rep in range(args.repeats):
        for name, fn in (("class 8", as_engine), ("from 16", from_16)):
            cuda_graphs.rank_class = fn
            graphs._graphs.clear()
            torch.cuda.synchronize()
            for d in counts:
                sets = adapter_sets(names, d, batch)
                decode_run(engine, sets, prompt_len, 8)  # captures
                res = decode_run(engine, sets, prompt_len, args.new_tokens)
                rank_classes = sorted({rank for _, cls, rank, _ in graphs._graphs if cls})
                rows.append({"variant": name, "pass": rep, "adapters": d, "rank_classes": rank_classes, **res})
                print(f"{name:<8} pass {rep} {d:>3} adapters: {res['tokens_per_s']:>9,.0f} tok/s "
                      f"(rank classes {rank_classes})", flush=True)
    cuda_graphs.rank_class = as_engine
    for r in rows:
        base = next(q["tokens_per_s"] for q in rows if q["variant"] == r["variant"] and q["pass"] == r["pass"]
                    and q["adapters"] == 0)
        r["vs_base"] = round(r["tokens_per_s"] / base, 3)
    print(f"\n{'variant':<8} {'pass':>4} {'adapters':>8} {'tok/s':>9} {'vs base':>8}")
    for r in rows:
        print(f"{r['variant']:<8} {r['pass']:>4} {r['adapters']:>8} {r['tokens_per_s']:>9,.0f} {r['vs_base']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "batch": batch, "prompt_len": prompt_len,
                                    "pool_rank": 64, "adapter_rank": 8, "new_tokens": args.new_tokens,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

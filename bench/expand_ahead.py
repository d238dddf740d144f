"""The tl.dot expand's loads ahead (`triton_lora.EXPAND_AHEAD`) over the kernel table's cases, on the GPU.

    python -m bench.expand_ahead [--values 0,1,2] [--rounds 2] [--min-tokens 16]
                                 [--out bench/results/expand-ahead-h200.json]

For each case of bench/kernels.py's table with at least --min-tokens tokens, `add_lora_triton` at
`pick_config`'s default is timed with each value in turn, --rounds times over (values interleaved
within a case, so a drift of the machine hits all of them). Timing as in bench/kernels.py. Prints
each case's median per value and its ratio to the first value; rows {case..., ahead, round, lora_us}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from bench.graph_timing import measure_copy_bandwidth
from bench.kernel_cases import MODULES, case_meta, case_token_slots, main_cases
from bench.kernel_runner import run_case
from lorafleet.kernels import triton_lora


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--out", default="bench/results/expand-ahead-h200.json")
    args = ap.parse_args(argv)
    values = [int(v) for v in args.values.split(",")]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows, initial = [], triton_lora.EXPAND_AHEAD
    try:
        for case in (c for c in main_cases(False) if c.tokens >= args.min_tokens):
            d_in, outs = MODULES[case.module]
            slots = case_token_slots(case)
            meta = case_meta(case, slots, torch.ones(slots.shape))
            cfg = triton_lora.pick_config(meta.num_chunks, len(outs), d_in, meta.chunk_size, meta.one_pair_chunks)
            us: dict[int, list[float]] = {v: [] for v in values}
            for rnd in range(args.rounds):
                for v in values:
                    triton_lora.EXPAND_AHEAD = v
                    row = run_case(case, bandwidth, g, config=cfg, baselines=False)
                    us[v].append(row["lora_us"])
                    rows.append({**asdict(case), "ahead": v, "round": rnd, "lora_us": row["lora_us"],
                                 "floor_us": row["floor_us"], "rel_err": row["rel_err"]})
            med = {v: statistics.median(t) for v, t in us.items()}
            print(f"{case.module:8s} T={case.tokens:3d} A={case.adapters:3d} r={case.rank:2d}/{case.pool_rank:2d} "
                  f"k={case.k} {case.b_layout[:4]}: " + "  ".join(
                      f"{v}: {med[v]:6.2f} ({med[v] / med[values[0]]:.3f})" for v in values), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()
    finally:
        triton_lora.EXPAND_AHEAD = initial
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

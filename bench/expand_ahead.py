"""The tl.dot expand's loads ahead (`triton_lora.EXPAND_AHEAD`) over the kernel table's cases, on the GPU.

    python -m bench.expand_ahead [--settings off,few,all] [--rounds 2] [--min-tokens 16] [--max-adapters N]
                                 [--cases MODULE:TOKENS:ADAPTERS,...] [--out bench/results/expand-ahead-h200.json]

For each case (bench/kernels.py's table with at least --min-tokens tokens, or --cases at rank 16),
`add_lora_triton` at `pick_config`'s default is timed under each setting of EXPAND_AHEAD in turn
(off: never; few: with at most SHRINK_FEW_CHUNKS chunks, the default; all: always), --rounds
times over (settings interleaved within a case, so a drift of the machine hits all of them). A
setting applies only to expands of several tiles a program (`pick_config`). Timing as in
bench/kernels.py. Prints each case's median per setting and its ratio to the first; rows
{case..., setting, expand_ahead, round, lora_us}.

`expand-ahead-h200.json` is from the knob's first form (commit f1b180c): one int for every launch,
0 = off, 1 = y loaded with B (no change), 2 = ahead, programs of one tile included (where it ran
1.1-1.5x slower: hence only several tiles now). `expand-ahead-early-h200.json` is from commit f0797df,
whose setting few-early also issued the second tile's loads with the first's, before the wait for
the shrink (`EXPAND_AHEAD_EARLY`, removed after it: docs/benchmarks-history.md, twentieth session);
`expand-ahead-peel-h200.json` from 42b7abd, whose few was the lookahead with the last tile peeled
off the loop (`EXPAND_AHEAD_PEEL`, removed after it) and few-loop the loop form kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from bench.graph_timing import measure_copy_bandwidth
from bench.kernel_cases import MODULES, case_meta, case_token_slots, main_cases, parse_cases
from bench.kernel_runner import run_case
from lorafleet.kernels import triton_lora

SETTINGS = {"off": (False, False), "few": (True, False), "all": (True, True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="off,few,all")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-adapters", type=int, default=None, help="only the table's cases with at most this many")
    ap.add_argument("--cases", default=None, help="MODULE:TOKENS:ADAPTERS,... (rank 16) instead of the table's (then --min-tokens and --max-adapters do not apply)")
    ap.add_argument("--out", default="bench/results/expand-ahead-h200.json")
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {sorted(SETTINGS)}")
    cases = parse_cases(args.cases) if args.cases else [
        c for c in main_cases(False)
        if c.tokens >= args.min_tokens and (args.max_adapters is None or c.adapters <= args.max_adapters)]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows, initial = [], triton_lora.EXPAND_AHEAD
    try:
        for case in cases:
            d_in, outs = MODULES[case.module]
            slots = case_token_slots(case)
            meta = case_meta(case, slots, torch.ones(slots.shape))
            us: dict[str, list[float]] = {s: [] for s in settings}
            for rnd in range(args.rounds):
                for name in settings:
                    triton_lora.EXPAND_AHEAD = SETTINGS[name]
                    cfg = triton_lora.config_for_meta(meta, len(outs), d_in)
                    row = run_case(case, bandwidth, g, config=cfg, baselines=False)
                    us[name].append(row["lora_us"])
                    rows.append({**asdict(case), "setting": name, "expand_ahead": cfg.expand_ahead, "round": rnd,
                                 "lora_us": row["lora_us"], "floor_us": row["floor_us"], "rel_err": row["rel_err"]})
            med = {s: statistics.median(t) for s, t in us.items()}
            print(f"{case.module:8s} T={case.tokens:4d} A={case.adapters:3d} r={case.rank:2d}/{case.pool_rank:2d} "
                  f"k={case.k} {case.b_layout[:4]}: " + "  ".join(
                      f"{s}: {med[s]:6.2f} ({med[s] / med[settings[0]]:.3f})" for s in settings), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()
    finally:
        triton_lora.EXPAND_AHEAD = initial
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

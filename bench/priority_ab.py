"""Experiment: stream priorities for the LoRA side path beside the base GEMMs, on one engine.

    python -m bench.priority_ab [--variants 0,1,2] [--adapters 0,8,64] [--repeats 2] [--out FILE]

The decode graphs keep each kernel's stream priority (torch instantiates them with per-node
priorities), and the block scheduler starts a waiting higher-priority kernel's programs first as
SMs free up. Variants: the LoRA's side stream above the main path; the main path (the capture
stream) above the LoRA; each with and without the GEMM's SM carveout. Async decode at batch 64 on
the seed shape (as bench/engine.py), the decode graphs re-captured for each variant.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.engine import adapter_sets, decode_run, experiment_engine
from lorafleet.kernels import lora_ops

HIGH, LOW = -1, 0
# name -> (capture stream priority or None for torch's private stream, LoRA stream priority, carveouts or None)
VARIANTS = {
    "as now": (None, LOW, None),
    "LoRA high": (None, HIGH, None),
    "main high": (HIGH, LOW, None),
    "LoRA high, no carveout": (None, HIGH, (0, 0, 0, 0)),
    "main high, no carveout": (HIGH, LOW, (0, 0, 0, 0)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", default="0,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="", help="comma-separated indices into VARIANTS ('' = all)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/priority-ab-h200.json"))
    args = ap.parse_args()
    picked = [list(VARIANTS)[int(i)] for i in args.variants.split(",") if i] or list(VARIANTS)
    counts = [int(x) for x in args.adapters.split(",") if x]
    engine, names = experiment_engine(args.batch, max(counts + [1]))
    graphs = engine.runner.graphs
    dev = engine.device
    carveouts = lora_ops.GEMM_SM_CARVEOUT
    print("stream priority range (least, greatest):", torch.cuda.Stream.priority_range(), flush=True)
    rows = []
    for rep in range(args.repeats):
        for name in picked:
            capture, lora, carve = VARIANTS[name]
            graphs.capture_stream = None if capture is None else torch.cuda.Stream(dev, priority=capture)
            engine.model.lora_stream = torch.cuda.Stream(dev, priority=lora)
            lora_ops.GEMM_SM_CARVEOUT = carveouts if carve is None else carve
            graphs._graphs.clear()  # re-capture under this variant
            torch.cuda.synchronize()
            for d in counts:
                sets = adapter_sets(names, d, args.batch)
                decode_run(engine, sets, args.prompt_len, 8)  # captures
                res = decode_run(engine, sets, args.prompt_len, args.new_tokens)
                rows.append({"variant": name, "pass": rep, "adapters": d, **res})
                print(f"pass {rep} {name:<26} {d:>3} adapters: {res['tokens_per_s']:>9,.0f} tok/s"
                      f"  step {res['decode_step_ms']} ms", flush=True)
    first = picked[0]
    for r in rows:
        same = [q for q in rows if q["pass"] == r["pass"]]
        base = next((q["tokens_per_s"] for q in same if q["variant"] == r["variant"] and q["adapters"] == 0), None)
        r["vs_base"] = round(r["tokens_per_s"] / base, 3) if base else None
        ref = next(q for q in same if q["variant"] == first and q["adapters"] == r["adapters"])
        r["vs_first_variant"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 4)
    print(f"\n{'pass':>4} {'variant':<26} {'adapters':>8} {'tok/s':>9} {'vs base':>8} {'vs first':>8}")
    for r in rows:
        print(f"{r['pass']:>4} {r['variant']:<26} {r['adapters']:>8} {r['tokens_per_s']:>9,.0f}"
              f" {r['vs_base']!s:>8} {r['vs_first_variant']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
                                    "new_tokens": args.new_tokens, "batch": args.batch,
                                    "variants": {k: list(v) for k, v in VARIANTS.items()}, "engine": rows}, indent=1))


if __name__ == "__main__":
    main()

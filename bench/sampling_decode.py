"""Decode throughput by sampling mode on the GPU: what a request's sampling knobs cost the engine.

    python -m bench.sampling_decode [--batch 64] [--prompt-len 128] [--new-tokens 128] [--repeats 2]
                                    [--draws torch,triton] [--out bench/results/sampling-decode-h200.json]
                                    [--tiny]  (a tiny shape on CPU: checks the script, measures nothing)

The seed-shape engine of the one-engine experiments (bench/engine_build.py: random bf16 weights,
CUDA graphs, async scheduling), base-only batches of `--batch` requests, every request with the
same knobs: greedy, temperature 0.8, top-k 50, top-p 0.9, top-k 50 with top-p 0.9, min-p 0.05.
Each sampled mode runs with each draw of worker/sampling.py (`CUDA_DRAW`: the torch draw sorts
every row for top-p; kernels/draw_triton.py does not), interleaved `--repeats` times so the
machine's drift hits all of them. Prints tokens/s per mode and draw, and writes the rows
{mode, draw, repeat, tokens_per_s, decode_step_ms}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.engine_build import build_engine, experiment_engine
from bench.engine_workload import adapter_sets, decode_run
from bench.sampling_cost import MODES
from lorafleet.worker import sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draws", default="torch,triton")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    if args.tiny:
        tiny = argparse.Namespace(tiny=True, rank=16, batch=args.batch, modes="eager")
        engine, names = build_engine(tiny, "cpu", 1)[0], ["-"]
    else:
        engine, names = experiment_engine(args.batch, 1)
    sets = adapter_sets(names, 0, args.batch)
    draws = args.draws.split(",")
    cases = [(name, draw) for name in MODES for draw in (["-"] if name == "greedy" else draws)]
    for name, draw in cases:  # warm-up: JIT, graph buckets
        sampling.CUDA_DRAW = draw if draw != "-" else sampling.CUDA_DRAW
        decode_run(engine, sets, args.prompt_len, 16, MODES[name])
    rows = []
    for rep in range(args.repeats):
        for name, draw in cases:
            if draw != "-":
                sampling.CUDA_DRAW = draw
            res = decode_run(engine, sets, args.prompt_len, args.new_tokens, MODES[name])
            rows.append({"mode": name, "draw": draw, "repeat": rep, "tokens_per_s": res["tokens_per_s"],
                         "decode_step_ms": res["decode_step_ms"]})
            print(f"{name:22} {draw:7} {res['tokens_per_s']:>10,.0f} tok/s  step {res['decode_step_ms']} ms", flush=True)
    greedy = statistics.median(r["tokens_per_s"] for r in rows if r["mode"] == "greedy")
    print(f"\n{'mode':22} {'draw':7} {'tok/s':>10} {'vs greedy':>10}")
    for name, draw in cases:
        tps = statistics.median(r["tokens_per_s"] for r in rows if (r["mode"], r["draw"]) == (name, draw))
        print(f"{name:22} {draw:7} {tps:>10,.0f} {tps / greedy:>10.3f}")
    if args.out:
        device = "cpu (--tiny smoke run)" if args.tiny else torch.cuda.get_device_name()
        meta = {"device": device, "torch": torch.__version__, "batch": args.batch,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Decode-graph variants timed on one engine: the greedy pick in the graph, PDL for the row
kernels (an H200 experiment).

    python -m bench.decode_ab [--variants 0,1,2] [--adapters 0,8,64] [--repeats 2] [--out FILE]

1. The op alone: `kernels/sampling/greedy.py`'s kernels over bf16 logits `[rows, 100,000]` against what a
   greedy batch ran before them: the lm_head output's conversion to float32, a row sum for the
   finiteness check, the argmax and the `where` (sampling.sample_on_device), each way replayed
   from a CUDA graph (`triton.testing.do_bench_cudagraph`, median µs).
2. In the engine: async decode at batch 64 on the seed shape (as bench/engine.py), on one engine,
   the decode graphs re-captured under each variant of VARIANTS (`DecodeGraphs.pick_in_graph`;
   `pdl.ROW_KERNELS`, the row kernels, attention and the pick launched with programmatic
   dependent launch), the variant list run `--repeats` times.

Prints both tables and writes `bench/results/decode-ab-h200.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton.testing

from bench.engine_build import experiment_engine
from bench.engine_workload import adapter_sets, decode_run
from lorafleet.kernels import pdl
from lorafleet.kernels.sampling.greedy import greedy_pick, greedy_pick_reference

VOCAB = 100_000
ALWAYS = dict.fromkeys(pdl.ROW_KERNELS, "always")
NEVER = dict.fromkeys(pdl.ROW_KERNELS, "never")
SELECTED = {**ALWAYS, "rms_norm": "never", "silu_mul": "never"}  # the kernels behind a GEMM left out
# name -> (DecodeGraphs.pick_in_graph, pdl.ROW_KERNELS)
VARIANTS = {
    "pick in graph, PDL row kernels": (True, ALWAYS),
    "pick in graph": (True, NEVER),
    "neither (the tenth session's graphs)": (False, NEVER),
    "pick, PDL for rope/attention/pick": (True, SELECTED),
    "pick, PDL as now (norm/silu with a delta)": (True, dict(pdl.ROW_KERNELS)),
}


def torch_passes(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a greedy batch ran before the pick: float32 logits, then sampling's two reductions."""
    full = logits.float()
    finite = torch.isfinite(full.sum(dim=-1))
    tokens = full.argmax(dim=-1)
    return tokens, torch.where(finite, tokens, -1)


def op_rows(rows_list: list[int]) -> list[dict]:
    out = []
    for rows in rows_list:
        x = torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)
        want = greedy_pick_reference(x)
        got = greedy_pick(x, "triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pick_us = 1e3 * triton.testing.do_bench_cudagraph(lambda x=x: greedy_pick(x, "triton"))
        torch_us = 1e3 * triton.testing.do_bench_cudagraph(lambda x=x: torch_passes(x))
        row = {"rows": rows, "vocab": VOCAB, "pick_us": round(pick_us, 2), "torch_us": round(torch_us, 2),
               "pick_gbps": round(rows * VOCAB * 2 / pick_us / 1e3, 1)}
        out.append(row)
        print(f"rows {rows:>3}: pick {pick_us:7.2f} us ({row['pick_gbps']} GB/s)   torch passes {torch_us:7.2f} us",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", default="0,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="", help="comma-separated indices into VARIANTS ('' = all)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode-ab-h200.json"))
    args = ap.parse_args()
    picked = [list(VARIANTS)[int(i)] for i in args.variants.split(",") if i] or list(VARIANTS)
    ops = op_rows([1, 8, 16, 64])
    counts = [int(x) for x in args.adapters.split(",") if x]
    engine, names = experiment_engine(args.batch, max(counts + [1]))
    graphs = engine.runner.graphs
    rows = []
    for rep in range(args.repeats):
        for name in picked:
            graphs.pick_in_graph, kernels = VARIANTS[name]
            pdl.ROW_KERNELS.clear()
            pdl.ROW_KERNELS.update(kernels)
            graphs._graphs.clear()  # re-capture under this variant
            torch.cuda.synchronize()
            for d in counts:
                sets = adapter_sets(names, d, args.batch)
                decode_run(engine, sets, args.prompt_len, 8)  # captures
                res = decode_run(engine, sets, args.prompt_len, args.new_tokens)
                rows.append({"variant": name, "pass": rep, "adapters": d, **res})
                print(f"pass {rep} {name:<38} {d:>3} adapters: {res['tokens_per_s']:>9,.0f} tok/s"
                      f"  step {res['decode_step_ms']} ms", flush=True)
    last = picked[-1]
    for r in rows:
        same = [q for q in rows if q["pass"] == r["pass"]]
        base = next((q["tokens_per_s"] for q in same if q["variant"] == r["variant"] and q["adapters"] == 0), None)
        r["vs_base"] = round(r["tokens_per_s"] / base, 3) if base else None
        ref = next(q for q in same if q["variant"] == last and q["adapters"] == r["adapters"])
        r["vs_last_variant"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 4)
    print(f"\n{'pass':>4} {'variant':<38} {'adapters':>8} {'tok/s':>9} {'vs base':>8} {'vs last':>8}")
    for r in rows:
        print(f"{r['pass']:>4} {r['variant']:<38} {r['adapters']:>8} {r['tokens_per_s']:>9,.0f}"
              f" {r['vs_base']!s:>8} {r['vs_last_variant']:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
                                    "new_tokens": args.new_tokens, "batch": args.batch, "op": ops,
                                    "engine": rows}, indent=1))


if __name__ == "__main__":
    main()

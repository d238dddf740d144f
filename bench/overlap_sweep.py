"""Decode throughput with the LoRA side path and the LoRA kernels' tuning set differently, on the GPU.

    python -m bench.overlap_sweep [--adapters 0,1,8,64] [--new-tokens 64] [--variants 0,3] [--repeats 1]
                                  [--out bench/results/overlap-sweep-h200.json]
    python -m bench.overlap_sweep --list        (the variants, numbered)

Each variant is a set of the settings a user has (LORAFLEET_* environment variables, read at
start-up: kernels/envs.py, worker/envs.py): the BLAS library, where the side path runs and how
(LORAFLEET_OVERLAP_MAX_CHUNKS, _GEMM_SM_CARVEOUT, _GEMM_FIRST, _DELTA_STORE, _ZERO_IN_SHRINK,
_LORA_FEW_CHUNKS) and the LoRA kernels' tuning (LORAFLEET_LORA_TUNING, inline JSON of the fields
changed). "defaults" sets nothing; every other variant changes one choice from the defaults, so a
row says what that choice is worth today. Each variant runs in a process of its own (bench.variants)
on the seed-shape async engine of bench/engine_build.py, timing decode at batch 64 as
`bench/engine.py` does. Rows: variant, pass, adapters, tok/s, ratio to the same variant's
base-only run (or the first variant's where it has none).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TUNING = "LORAFLEET_LORA_TUNING"

# name -> the environment it runs with (over the caller's).
VARIANTS: dict[str, dict[str, str]] = {
    "defaults": {},
    "cuBLAS (no SM carveout)": {"LORAFLEET_BLAS": "cublas"},
    "LoRA after the GEMM (never beside)": {"LORAFLEET_OVERLAP_MAX_CHUNKS": "0"},
    "beside, no carveout": {"LORAFLEET_GEMM_SM_CARVEOUT": "0"},
    "beside, carveout 48 everywhere": {"LORAFLEET_GEMM_SM_CARVEOUT": "48"},
    "LoRA launched before the GEMM": {"LORAFLEET_GEMM_FIRST": "0"},
    "expand adds into a zeroed delta": {"LORAFLEET_DELTA_STORE": "0"},
    "expand adds, a memset zeroes": {"LORAFLEET_DELTA_STORE": "0", "LORAFLEET_ZERO_IN_SHRINK": "0"},
    "expand adds, shrink zeroes always": {"LORAFLEET_DELTA_STORE": "0", "LORAFLEET_LORA_FEW_CHUNKS": "0"},
    "shrink 4 warps with many chunks": {TUNING: '{"shrink_warps": [4, 4]}'},
    "expand 256 columns a program with many chunks": {TUNING: '{"wide_expand": [256, 512]}'},
    "few-chunk shrink K tile 128": {TUNING: '{"shrink_block_k": [128, 128]}'},
    "no row-at-a-time shrink": {TUNING: '{"shrink_rows": []}'},
    "no row-at-a-time expand": {TUNING: '{"expand_rows": []}'},
    "row expand without a register cap": {TUNING: '{"expand_rows": [512, 2]}'},
    "row shrink up to 2 pairs a chunk": {TUNING: '{"one_pair_chunks": [2.0, 2]}'},
    "expand loads ahead with many chunks too": {TUNING: '{"expand_ahead": [true, true]}'},
    "no expand loads ahead": {TUNING: '{"expand_ahead": [false, false]}'},
    "splits summed in a loop": {TUNING: '{"split_sum": "loop"}'},
    "chunk meta in separate rounds": {TUNING: '{"meta_round": false}'},
}


def run_variant(args: argparse.Namespace, name: str, rep: int) -> list[dict]:
    """Time every adapter count under this process's settings (a child's: its variant's)."""
    import torch

    from bench.engine_build import experiment_engine
    from bench.engine_workload import adapter_sets, decode_run

    counts = [int(x) for x in args.adapters.split(",") if x]
    engine, names = experiment_engine(args.batch, max(counts + [1]))
    rows = []
    for d in counts:
        sets = adapter_sets(names, d, args.batch)
        decode_run(engine, sets, args.prompt_len, 8)  # captures
        res = decode_run(engine, sets, args.prompt_len, args.new_tokens)
        rows.append({"variant": name, "pass": rep, "settings": VARIANTS[name], "adapters": d, **res})
        print(f"{name:<40} {d:>3} adapters: {res['tokens_per_s']:>9,.0f} tok/s  step {res['decode_step_ms']} ms",
              flush=True)
    torch.cuda.synchronize()
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens/s against its variant's base-only run in the same pass (else the first)."""
    first_base = next((r["tokens_per_s"] for r in rows if r["adapters"] == 0), None)
    for r in rows:
        own = next((q["tokens_per_s"] for q in rows if q["variant"] == r["variant"] and q["pass"] == r["pass"]
                    and q["adapters"] == 0), None)
        base = own or first_base
        r["vs_base"] = round(r["tokens_per_s"] / base, 3) if base else None
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", default="0,1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variants", default="", help="comma-separated indices into VARIANTS, in order ('' = all)")
    ap.add_argument("--repeats", type=int, default=1, help="run the variant list this many times (noise)")
    ap.add_argument("--list", action="store_true", help="print the variants, numbered, and exit")
    ap.add_argument("--out", type=Path, default=Path("bench/results/overlap-sweep-h200.json"))
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: its variant's name
    ap.add_argument("--pass", dest="rep", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rows-to", type=Path, help=argparse.SUPPRESS)
    return ap


def picked(ap: argparse.ArgumentParser, text: str) -> list[str]:
    names = list(VARIANTS)
    try:
        out = [names[int(i)] for i in text.split(",") if i]
    except (ValueError, IndexError):
        ap.error(f"--variants takes indices 0-{len(names) - 1}, got {text!r}")
    return out or names


def main(argv: list[str] | None = None) -> int:
    from bench.variants import run_child

    ap = parser()
    args = ap.parse_args(argv)
    if args.list:
        for i, (name, env) in enumerate(VARIANTS.items()):
            print(f"{i:>3}  {name:<48} {' '.join(f'{k}={v}' for k, v in env.items()) or '(nothing set)'}")
        return 0
    if args.rows_to:
        args.rows_to.write_text(json.dumps(run_variant(args, args.variant, args.rep)))
        return 0
    todo = picked(ap, args.variants)
    common = ["--adapters", args.adapters, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
              "--batch", str(args.batch)]
    rows: list[dict] = []
    for rep in range(args.repeats):
        for name in todo:
            rows += run_child("bench.overlap_sweep", VARIANTS[name], [*common, "--variant", name, "--pass", str(rep)])
    with_ratios(rows)
    print(f"\n{'variant':<48} {'pass':>4} {'adapters':>8} {'tok/s':>9} {'vs base':>8}")
    for r in rows:
        print(f"{r['variant']:<48} {r['pass']:>4} {r['adapters']:>8} {r['tokens_per_s']:>9,.0f} {r['vs_base']!s:>8}")
    import torch

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
                                    "new_tokens": args.new_tokens, "batch": args.batch, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

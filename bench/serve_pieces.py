"""bench/serve.py in pieces: the device calls of its GPU run, and each piece's JSON merged into the last.

A GPU run of bench/serve.py takes longer than one device call (10 minutes), so it runs in pieces
(`python -m bench.serve --print-gpu-commands` prints them), each a serve.py command with `--merge`:
the JSON the previous pieces wrote keeps its engine figures and rows (a row measured again replaces
its namesake, `row_key`), and its direct closed loops' peaks give the Poisson rates of later pieces,
per weights kind (`bf16`, `fp8`; rows written before FP8 existed are bf16).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_PIECES = (
    # (what it measures, serve.py arguments, expected minutes on an H100 (+1 where the adapters are
    # written again: a machine released between calls keeps nothing; the model's weights are never
    # written: the worker makes them, --load-format dummy), whether it starts from the committed
    # bench/results/serve-<gpu>.json when the run's own JSON is absent)
    ("64 adapters written (~1 min), the engine's figures at batch 64 for 0, 8 and 64 adapters (2.6 min on an H100)",
     "--engine-only --concurrency 64 --adapters 0,8,64 --prompts 128", 4, False),
    ("direct, closed loop c=64 and Poisson at 70% of its peak, base / 8 / 64 adapters", "--no-engine --quick --paths direct",
     5.5, False),
    ("through the router, the same loads (Poisson rates from the direct peaks)", "--no-engine --quick --paths router",
     5.5, False),
    # Issue 53's served rows beside the bf16 ones: its own engine figures (the FP8 engine, as
    # bench/engine_fp8.py builds it) and Poisson rates from its own peaks, the worker with the bf16
    # direct piece's 64 slots; runs after the pieces above or alone after a run already committed
    # (its rows are kept: --merge).
    ("FP8 weights (--quantization fp8): the FP8 engine's figures at "
     "batch 64 for 0 and 8 adapters, then direct closed loop c=64 and Poisson at 70% of its peak, base / 8 adapters",
     "--weights fp8 --quick --adapters 0,8 --max-loras 64 --paths direct", 6.5, True),
)


def gpu_commands() -> str:
    env = "source bench/gpu_env.sh && "
    seed = "mkdir -p .lorafleet/serve-results && cp -n bench/results/serve-*.json .lorafleet/serve-results/; "
    lines = ["# one device call each, in this order, from the repository root after `bash bench/gpu_wheels.sh`",
             "# (the last, FP8, also runs alone: it adds its rows to the committed JSON);",
             "# the model and the JSON stay in the ignored .lorafleet/ folder between calls (--merge adds to it);",
             "# copy $OUT/serve-results/serve-<gpu>.json into bench/results/ at the end"]
    for what, extra, minutes, seeded in GPU_PIECES:
        lines += [f"# {what} (~{minutes:g} min)",
                  f"{env}{seed if seeded else ''}timeout 540 python3 -m bench.serve --device cuda "
                  f"--workdir .lorafleet/serve-work --out .lorafleet/serve-results --merge {extra}; "
                  f"cp -r .lorafleet/serve-results \"$OUT\"/"]
    return "\n".join(lines)


def weights_of(r: dict) -> str:
    """A row's or engine figure's weights kind (rows measured before FP8 existed are bf16)."""
    return r.get("weights", "bf16")


def merged(out: Path, args: argparse.Namespace) -> tuple[dict, list[dict], dict, dict]:
    """The existing JSON's engine figures, rows, closed-loop peaks and worker command lines (empty
    without --merge)."""
    if not args.merge or not out.exists():
        return {}, [], {}, {}
    old = json.loads(out.read_text())
    engine = {(weights_of(e), e["batch"], e["prompt"], e["adapters"]): e["tokens_per_s"] for e in old.get("engine", [])}
    rows = old.get("rows", [])
    peaks: dict = {}
    for r in sorted((r for r in rows if r["path"] == "direct" and "concurrency" in r), key=lambda r: r["concurrency"]):
        peaks[(weights_of(r), r["prompt"], r["adapters"])] = r  # the largest concurrency last
    return engine, rows, peaks, dict(old.get("worker_commands", {}))


def row_key(r: dict) -> tuple:
    return (r["path"], weights_of(r), r["adapters"], r["prompt"], r.get("concurrency"), r.get("of_peak"))

"""Chunk size and launch configs for prefill-sized LoRA steps (many tokens an adapter), on the GPU.

    python -m bench.chunk_sweep [--cases qkv:256:1,...] [--chunk-sizes 16,32,64] [--budget-s 300]
                                [--out bench/results/chunk-sweep-h200.json]

`bench/kernels.py --sweep` tunes `pick_config` at the metadata's default chunk size
(`lora_meta.default_chunk_size`: 16 rows a program up to 512 pairs); this also varies the chunk
size, which only matters where an adapter has more than 16 of a step's tokens (prefill). For each
case and chunk size: `pick_config`'s default for that meta and a few knobs changed one at a time.
Timing as in bench/kernels.py. Rows: bench/kernels.py's, plus the config and `chunk_size`; written
after every case, so a run cut short by --budget-s keeps what it timed.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.graph_timing import measure_copy_bandwidth
from bench.kernel_cases import MODULES, Case, case_meta, case_token_slots
from bench.kernel_runner import run_case
from lorafleet.kernels.lora.config import LoraKernelConfig, config_for_meta, with_expand_tiles

DEFAULT_CASES = ",".join(f"{m}:256:{a}" for a in (1, 8, 64, 128) for m in MODULES)


def configs_for(default: LoraKernelConfig, num_chunks: int, chunk_size: int) -> list[LoraKernelConfig]:
    """The default and one knob changed at a time (a smaller grid than kernel_sweep's); tiles with
    `expand_ahead` as `pick_config` would set it for them."""
    out = {default}
    for n_per_prog, block_n in ((128, 64), (128, 128), (256, 64), (256, 128), (256, 256), (512, 128),
                                (512, 512), (1024, 256)):
        out.add(with_expand_tiles(default, num_chunks, chunk_size, n_per_prog, block_n))
    for split_k in {max(1, default.split_k // 2), default.split_k * 2}:
        out.add(replace(default, split_k=split_k))
    out.add(replace(default, expand_warps=8))
    for stages in (2, 4):
        out.add(replace(default, num_stages=stages))
    return sorted(out, key=lambda c: (c != default, c.n_per_prog, c.block_n, c.split_k, c.expand_warps, c.num_stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="MODULE:TOKENS:ADAPTERS,...")
    ap.add_argument("--chunk-sizes", default="16,32,64")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this long")
    ap.add_argument("--out", default="bench/results/chunk-sweep-h200.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    start, rows = time.monotonic(), []
    for spec in args.cases.split(","):
        if time.monotonic() - start > args.budget_s:
            print(f"budget spent: stopped before {spec}", flush=True)
            break
        module, tokens, adapters = spec.split(":")
        case = Case(module, int(tokens), int(adapters), 16, 16)
        d_in, outs = MODULES[module]
        per_adapter = case.tokens // case.adapters
        for chunk in (int(c) for c in args.chunk_sizes.split(",")):
            if chunk > 16 and chunk > per_adapter:  # no chunk would be longer than 16 rows
                continue
            slots = case_token_slots(case)
            meta = case_meta(case, slots, torch.ones(slots.shape), chunk)
            default = config_for_meta(meta, len(outs), d_in)
            case_rows = []
            for cfg in configs_for(default, meta.num_chunks, meta.chunk_size):
                row = run_case(case, bandwidth, g, config=cfg, baselines=False, chunk_size=chunk)
                row.update(asdict(cfg), default=cfg == default)
                case_rows.append(row)
            best = min(case_rows, key=lambda r: r["lora_us"])
            knobs = {k: best[k] for k in ("split_k", "n_per_prog", "block_n", "expand_warps", "num_stages")}
            print(f"{module:8s} T={case.tokens} A={case.adapters:3d} chunk {chunk:2d}: default "
                  f"{case_rows[0]['lora_us']} µs, best {best['lora_us']} µs {knobs}, floor {best['floor_us']} µs",
                  flush=True)
            rows += case_rows
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The LoRA kernels' two launches timed apart, each against its own memory floor, over launch configs.

    python -m bench.lora_parts [--cases qkv:64:64,gate_up:64:64,...] [--store] [--parts shrink,expand]
                               [--out bench/results/lora-parts-h200.json]

`bench/kernels.py` times the shrink and the expand together (what the engine pays); this says which
of the two is far from the bytes it moves, and which launch parameters move it:

  shrink     `launch_shrink` alone: reads x and each distinct adapter's A (every slice, true rank),
             writes the fp32 split-K partials.
  expand     `launch_expand` alone, without programmatic dependent launch (the partials are
             already there): reads the partials and B, reads and writes y (`store`: writes only).
  pair       both, the expand with PDL where supported: what `add_lora_triton` runs.
  copy       a device-to-device copy moving the shrink's bytes (bench/graph_timing.py `copy_us`): what a
             launch of that size costs at all.

Each part's floor is its own bytes over the copy bandwidth measured in the run. Configs: the
default (`pick_config`) and one knob changed at a time (for the parts named in --parts; the others
at the default only); then the pair with each part's best knobs together. Timing as in bench/kernels.py (a CUDA graph over enough copies of the inputs to miss L2,
`do_bench` medians). Rows: {module, tokens, adapters, part, config..., us, floor_us}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from lorafleet.kernels.lora.config import LoraKernelConfig, config_for_meta, with_expand_tiles
from lorafleet.kernels.lora.launch import launch_expand, launch_shrink, plan_lora_triton

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import graph_timing
from bench import kernel_cases as kb

DEFAULT_CASES = "qkv:64:64,o:64:64,gate_up:64:64,down:64:64,qkv:64:8,gate_up:64:8"


def part_floors(case: kb.Case, split_k: int, bandwidth: float) -> dict[str, float]:
    """Bytes each launch must move, over the bandwidth, in µs."""
    d_in, outs = kb.MODULES[case.module]
    a_bytes = case.adapters * case.rank * len(outs) * d_in * kb.BYTES
    b_bytes = kb.adapter_bytes(case) - a_bytes
    part_bytes = split_k * case.tokens * case.k * len(outs) * max(16, case.rank) * 4
    shrink = a_bytes + case.tokens * d_in * kb.BYTES + part_bytes
    expand = b_bytes + part_bytes + 2 * case.tokens * sum(outs) * kb.BYTES
    return {"shrink": shrink / bandwidth * 1e6, "expand": expand / bandwidth * 1e6}


def variants(default: LoraKernelConfig, num_chunks: int, chunk_size: int) -> dict[str, list[LoraKernelConfig]]:
    """Each part's knobs changed one at a time from the default; the expand's tiles with
    `expand_ahead` as `pick_config` would set it for them."""
    shrink = {default}
    for split_k in (max(1, default.split_k // 2), default.split_k * 2):
        shrink.add(replace(default, split_k=split_k))
    for block_k in (64, 128, 256):
        shrink.add(replace(default, block_k=block_k))
    for warps in (2, 8):
        shrink.add(replace(default, shrink_warps=warps))
    for stages in (2, 4, 5):
        shrink.add(replace(default, num_stages=stages))
    for block_k, stages in ((512, 1), (512, 2), (1024, 1), (1024, 2)):  # most of a K range in flight at once
        shrink.add(replace(default, block_k=block_k, num_stages=stages))
    expand = {default}
    for n_per_prog in (128, 256, 512, 1024, 2048):
        for block_n in (64, 128, 256):
            if block_n <= n_per_prog:
                expand.add(with_expand_tiles(default, num_chunks, chunk_size, n_per_prog, block_n))
    for warps in (2, 8):
        expand.add(replace(default, expand_warps=warps))
    for stages in (1, 2, 4):
        expand.add(replace(default, num_stages=stages))
    for block_n, warps in ((128, 1), (128, 2), (256, 1), (256, 2), (512, 1), (512, 2), (512, 4), (1024, 2),
                           (1024, 4)):  # a row at a time
        expand.add(replace(default, expand_rows=True, expand_ahead=False, block_n=block_n, n_per_prog=block_n, expand_warps=warps))
    return {"shrink": sorted(shrink, key=str), "expand": sorted(expand, key=str)}


def run_case(case: kb.Case, bandwidth: float, g: torch.Generator, store: bool,
             parts: list[str] | None = None) -> list[dict]:
    d_in, outs = kb.MODULES[case.module]
    sets, token_slots, token_scales, ranks = kb.make_case_inputs(case, g)
    meta = kb.case_meta(case, token_slots, token_scales)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    default = config_for_meta(meta, len(outs), d_in)

    def plans(cfg: LoraKernelConfig, pdl: bool) -> list:
        return [plan_lora_triton(s.x, s.lora_a, s.lora_b, ranks_dev, meta, cfg, pdl) for s in sets]

    def time_part(part: str, cfg: LoraKernelConfig) -> float:
        ps = plans(cfg, pdl=part == "pair")
        if part == "shrink":
            calls = [lambda p=p: launch_shrink(p) for p in ps]
        else:
            for p in ps:  # partials for the expand to read
                launch_shrink(p)
            if part == "expand":
                calls = [lambda p=p, s=s: launch_expand(p, s.y, store) for p, s in zip(ps, sets, strict=True)]
            else:
                calls = [lambda p=p, s=s: (launch_shrink(p), launch_expand(p, s.y, store))
                         for p, s in zip(ps, sets, strict=True)]
        return graph_timing.time_graph(calls)

    rows, best = [], {}
    head = {"module": case.module, "tokens": case.tokens, "adapters": case.adapters, "rank": case.rank,
            "store": store}
    # What a plain device copy moving the shrink's bytes (A, x and the partials: half read, half
    # written) takes, timed the same way: how near its floor a launch of this size can get at all.
    floor = part_floors(case, default.split_k, bandwidth)["shrink"]
    us = graph_timing.copy_us(floor * 1e-6 * bandwidth)
    rows.append({**head, "part": "copy", "us": round(us, 2), "floor_us": round(floor, 2)})
    print(f"{case.module:8s} T={case.tokens} A={case.adapters} copy of the shrink's bytes: {us:6.2f} µs, "
          f"floor {floor:.2f}", flush=True)
    for part, cfgs in variants(default, meta.num_chunks, meta.chunk_size).items():
        if parts and part not in parts:
            cfgs = [default]
        timed = []
        for cfg in cfgs:
            us = time_part(part, cfg)
            floor = part_floors(case, cfg.split_k, bandwidth)[part]
            timed.append((us, cfg))
            rows.append({**head, "part": part, **asdict(cfg), "default": cfg == default, "us": round(us, 2),
                         "floor_us": round(floor, 2)})
        best[part] = min(timed, key=lambda t: t[0])
        d_us = next(us for us, c in timed if c == default)
        print(f"{case.module:8s} T={case.tokens} A={case.adapters} {part:6s}: default {d_us:6.2f} µs, best "
              f"{best[part][0]:6.2f} µs {best[part][1]}, floor {part_floors(case, default.split_k, bandwidth)[part]:.2f}",
              flush=True)
    s, e = best["shrink"][1], best["expand"][1]
    combined = replace(e, split_k=s.split_k, block_k=s.block_k, shrink_warps=s.shrink_warps)
    for label, cfg in (("default", default), ("best parts", combined)):
        us = time_part("pair", cfg)
        floors = part_floors(case, cfg.split_k, bandwidth)
        rows.append({**head, "part": "pair", "label": label, **asdict(cfg), "default": cfg == default,
                     "us": round(us, 2), "floor_us": round(floors["shrink"] + floors["expand"], 2)})
        print(f"{case.module:8s} T={case.tokens} A={case.adapters} pair   {label}: {us:6.2f} µs {cfg}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="MODULE:TOKENS:ADAPTERS,...")
    ap.add_argument("--store", action="store_true", help="the storing expand (the engine's side path)")
    ap.add_argument("--parts", default="shrink,expand", help="which parts' variants to time")
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora-parts-h200.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = graph_timing.measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for case in kb.parse_cases(args.cases):
        rows += run_case(case, bandwidth, g, args.store, args.parts.split(","))
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bandwidth_tb_s": round(bandwidth / 1e12, 3), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

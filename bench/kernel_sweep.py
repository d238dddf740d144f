"""The launch-config sweep of the kernel benchmark (`--sweep`): times `add_lora_triton` under
`pick_config`'s default and one knob changed at a time, on a few representative cases, to tune it."""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from bench.kernel_cases import MODULES, Case, case_meta, case_token_slots
from bench.kernel_runner import run_case
from lorafleet.kernels.lora.config import config_for_meta, with_expand_tiles

SWEEP_CASES = [(16, 1), (64, 8), (64, 64), (256, 128)]


def sweep(bandwidth: float, g: torch.Generator, cases: list[tuple[int, int]] = SWEEP_CASES) -> list[dict]:
    """Time launch configs on representative (tokens, adapters) cases, to tune `pick_config`."""
    rows = []
    for module, (d_in, outs) in MODULES.items():
        n_slices = len(outs)
        for tokens, adapters in cases:
            case = Case(module, tokens, adapters, 16, 16)
            slots = case_token_slots(case)
            meta = case_meta(case, slots, torch.ones(slots.shape))
            default = config_for_meta(meta, n_slices, d_in)
            configs = {default}
            for n_per_prog in (128, 256, 512, 1024, 2048, 4096):
                for block_n in (64, 128, 256):
                    if block_n <= n_per_prog:
                        configs.add(with_expand_tiles(default, meta.num_chunks, meta.chunk_size, n_per_prog, block_n))
            for split_k in (1, max(1, default.split_k // 2), default.split_k * 2):
                configs.add(replace(default, split_k=split_k))
            for block_k in (64, 128, 256):
                configs.add(replace(default, block_k=block_k))
            configs.add(replace(default, expand_warps=8))
            configs.add(replace(default, shrink_warps=2))
            case_rows = []
            for cfg in sorted(configs, key=lambda c: (c.split_k, c.n_per_prog, c.block_n, c.expand_warps)):
                row = run_case(case, bandwidth, g, config=cfg, baselines=False)
                row.update(asdict(cfg), default=cfg == default)
                case_rows.append(row)
            best = min(case_rows, key=lambda r: r["lora_us"])
            default_us = next(r["lora_us"] for r in case_rows if r["default"])
            knobs = {k: best[k] for k in ("split_k", "n_per_prog", "block_n", "block_k", "shrink_warps", "expand_warps")}
            print(
                f"sweep {module:8s} T={tokens:4d} A={adapters:4d}: default {default_us} µs, "
                f"best {best['lora_us']} µs {knobs}, floor {best['floor_us']} µs",
                flush=True,
            )
            rows += case_rows
    return rows

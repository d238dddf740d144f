"""The LoRA kernels a row at a time for chunks of a few pairs (an H200 experiment).

    python -m bench.row_groups [--out bench/results/row-groups-h200.json]

Decode steps with a few tokens an adapter (64 tokens on 16 or 32 adapters, 256 on 64 or 128, or
two adapters a token) cut their pairs into chunks of 2-4. Each case is timed as `bench/kernels.py`
times its rows, under three configs from `pick_config`: the tl.dot modes (row group 0, what such
steps run by default), both kernels a row at a time re-reading A for each row (group 1, the
one-pair chunks' mode), and the shrink a group of rows at once (the longest chunk's pairs rounded
up to a power of two).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.kernels import MODULES, Case, case_meta, case_token_slots, measure_copy_bandwidth, run_case
from lorafleet.kernels.triton_lora import pick_config

SHAPES = ((64, 32, 1), (64, 16, 1), (256, 128, 1), (256, 64, 1), (64, 64, 2), (64, 32, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/row-groups-h200.json"))
    args = ap.parse_args()
    bandwidth = measure_copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    rows = []
    for module, (d_in, outs) in MODULES.items():
        for tokens, adapters, k in SHAPES:
            case = Case(module, tokens, adapters, 16, 16, k=k)
            token_slots = case_token_slots(case)
            meta = case_meta(case, token_slots, torch.ones(token_slots.shape))
            group = 1 << (meta.longest_chunk - 1).bit_length()
            cells = []
            for name, row_group in (("tl.dot", 0), ("rows, one at a time", 1), (f"rows, {group} at a time", group)):
                cfg = pick_config(meta.num_chunks, len(outs), d_in, meta.chunk_size, row_group)
                row = run_case(case, bandwidth, g, config=cfg, baselines=False)
                rows.append({"config": name, "row_group": row_group, "longest_chunk": meta.longest_chunk, **row})
                cells.append(f"{name} {row['lora_us']:6.2f}")
            print(f"{module:<8} {tokens:>3} tokens {adapters:>3} adapters k={k} (chunks of {meta.longest_chunk}): "
                  + "  ".join(cells), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bandwidth}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

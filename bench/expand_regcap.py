"""The row-at-a-time LoRA expand under ptxas register caps (an H200 experiment).

    python -m bench.expand_regcap [--out bench/results/expand-regcap-h200.json]

At rank 16 the row expand (`lora_config.EXPAND_ROWS`: 512 columns, 2 warps) holds 204 registers a
thread, so 4 programs fit an SM. Each cap sets `EXPAND_ROWS[2]` (what `pick_config` passes as
`LoraKernelConfig.expand_maxnreg`) and times every module at 64 tokens on 64 and on 48 rank-16
adapters (one-pair steps: the rows run) as `bench/kernels.py` times its rows. The uncapped run
comes first and last (drift).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.graph_timing import measure_copy_bandwidth
from bench.kernel_cases import MODULES, Case
from bench.kernel_runner import run_case
from lorafleet.kernels.lora import config as lora_config

CAPS = (None, 144, 160, 168, 176, 192, None)
SHAPES = ((64, 64), (64, 48))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/expand-regcap-h200.json"))
    args = ap.parse_args()
    bandwidth = measure_copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    columns, warps = lora_config.EXPAND_ROWS[:2]
    rows = []
    for cap in CAPS:
        lora_config.EXPAND_ROWS = (columns, warps) if cap is None else (columns, warps, cap)
        cells = []
        for module in MODULES:
            for tokens, adapters in SHAPES:
                row = run_case(Case(module, tokens, adapters, 16, 16), bandwidth, g, baselines=False)
                rows.append({"cap": cap, **row})
                cells.append(f"{module}:{adapters} {row['lora_us']:6.2f}")
        print(f"cap {cap!s:>4}: " + "  ".join(cells), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bandwidth}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

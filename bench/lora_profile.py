"""Launch the LoRA shrink and expand once each per case, for a hardware-counter profiler.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --csv --page details \
        python3 -m bench.lora_profile [--cases down:64:64,qkv:64:64] [--store]

Each case is built as bench/kernels.py builds it (seed shapes, bf16, rank 16, `pick_config`),
launched twice to compile and warm up, then once more between cudaProfilerStart/Stop, plainly
(no PDL, no graph), so the profiler sees exactly one shrink and one expand per case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lorafleet.kernels.lora.config import config_for_meta
from lorafleet.kernels.lora.launch import launch_expand, launch_shrink, plan_lora_triton

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import MODULES, case_meta, make_case_inputs, parse_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="down:64:64,qkv:64:64,gate_up:64:64")
    ap.add_argument("--store", action="store_true", help="the storing expand (the engine's side path)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for case in parse_cases(args.cases):
        d_in, outs = MODULES[case.module]
        sets, token_slots, token_scales, _ = make_case_inputs(case, g)
        meta = case_meta(case, token_slots, token_scales)
        ranks_dev = torch.full((len(outs), case.adapters), case.rank, dtype=torch.int32, device="cuda")
        cfg = config_for_meta(meta, len(outs), d_in)
        s = sets[0]
        plan = plan_lora_triton(s.x, s.lora_a, s.lora_b, ranks_dev, meta, cfg, pdl=False)
        for _ in range(2):
            launch_shrink(plan)
            launch_expand(plan, s.y, args.store)
        torch.cuda.synchronize()
        print(f"{case.module}:{case.tokens}:{case.adapters}: {cfg}", flush=True)
        torch.cuda.profiler.start()
        launch_shrink(plan)
        launch_expand(plan, s.y, args.store)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()

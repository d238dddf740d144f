"""Time to first token of one fresh 512-token prompt, back to back and after idle pauses (an H200 experiment).

    python -m bench.ttft_pauses [--prompts 8] [--pauses 0,0.5,0,2,0] [--out FILE]

`bench/engine.py` reports the median of five prompts run back to back. On the lent H200 machines that
figure moved between runs and machines (15.7-34 ms) while the kernels took ~11.3 ms; this runs
series of prompts, each after a pause of the given length (0: back to back; a series of 0 after a
longer pause shows how long a slow spell lasts), and records per prompt, timed as bench/engine.py
times it (from the first step after the request is queued to its first token on the host): the wall
time, the GPU time between events recorded at those two points (a host-bound prefill shows in
both), and the SM clock NVML reports just before and after (`torch.cuda.clock_rate`, which needs
pynvml; NVML's reading is a recent sample, so a dip shorter than its sampling is not ruled out).
Rows: series, pause_s, prompt, ms, gpu_ms, sm_mhz_before, sm_mhz_after; a summary per series
(median (the upper one for an even count), min, max).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.engine_build import experiment_engine
from bench.engine_workload import fresh_prompt, sync
from lorafleet.worker.engine.sequence import SamplingParams


def first_token(engine, prompt_len: int) -> dict:
    """One fresh prompt to its first token: wall ms, GPU ms between events around it, SM clocks."""
    engine.add_request(fresh_prompt(engine, prompt_len), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync()
    clock_before = torch.cuda.clock_rate()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end.record()
    clock_after = torch.cuda.clock_rate()
    sync()
    return {"ms": round((time.perf_counter() - t0) * 1e3, 2), "gpu_ms": round(start.elapsed_time(end), 2),
            "sm_mhz_before": clock_before, "sm_mhz_after": clock_after}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per series")
    ap.add_argument("--pauses", default="0,0.5,0,2,0", help="seconds idle before each prompt of a series, per series")
    ap.add_argument("--out", type=Path, default=Path("bench/results/ttft-pauses-h200.json"))
    args = ap.parse_args()
    engine, _ = experiment_engine(64, 1)
    for _ in range(3):
        first_token(engine, args.prompt_len)
    rows, series = [], []
    for s, pause in enumerate(float(p) for p in args.pauses.split(",")):
        ms = []
        for i in range(args.prompts):
            time.sleep(pause)
            r = {"series": s, "pause_s": pause, "prompt": i, **first_token(engine, args.prompt_len)}
            rows.append(r)
            ms.append(r["ms"])
        series.append({"series": s, "pause_s": pause, "median_ms": sorted(ms)[len(ms) // 2], "min_ms": min(ms),
                       "max_ms": max(ms), "ms": ms})
        print(f"series {s}: pause {pause:>4} s  median {series[-1]['median_ms']:6.2f} ms  runs {ms}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
                                    "series": series, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

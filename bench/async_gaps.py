"""What the GPU runs, and where it idles, in base-only async decode steps (an H200 diagnostic).

    python -m bench.async_gaps [--trace FILE]

The seed shape as bench/engine.py builds it, 64 requests of 128-token prompts, async scheduling
(the default); 12 steady decode steps under torch.profiler (CUDA activity only). Prints the GPU
operations that are not per-layer kernels (seen fewer than 16 times a step: the step's input
copies, sampling, the copy of its tokens to the host, the lm_head GEMM), the span, busy and idle
time a step, and where the idle time falls (summed per pair of neighbouring operations).
`--trace FILE` profiles the host too and writes the Chrome trace (runtime calls with their
correlation ids to the GPU work they launched: when each step's copies and graph launch were
issued against when the GPU ran them).
docs/benchmarks-history.md ("Tenth session: what the GPU does between decode graphs") has a run.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_build import build_engine
from bench.engine_workload import fresh_prompt
from lorafleet.worker.engine.sequence import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="", help="also profile the host; write the Chrome trace here")
    trace = ap.parse_args().trace
    args = argparse.Namespace(tiny=False, rank=16, batch=64, modes="async")
    engine, model_config, _ = build_engine(args, "cuda", 1)
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for _ in range(64):
        engine.add_request(fresh_prompt(engine, 128), sp, ())
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=activities) as prof:
        for _ in range(12):
            engine.step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    counts = collections.Counter(e.name for e in ev)
    steps = 12
    print("events", len(ev), "per step", len(ev) / steps)
    layer = {n for n, c in counts.items() if c >= 16 * steps}
    print("names seen < 16x per step:")
    for n, c in counts.most_common():
        if n not in layer:
            tot = sum(e.time_range.elapsed_us() for e in ev if e.name == n)
            print(f"  {c / steps:5.1f}/step  {tot / c:8.2f} us each  {n[:110]}")
    # gaps on the GPU timeline (all streams merged)
    gaps, prev_end, prev_name = [], None, None
    for e in ev:
        if prev_end is not None:
            gaps.append((e.time_range.start - prev_end, prev_name, e.name))
        prev_end = max(prev_end or 0, e.time_range.end)
        prev_name = e.name
    span = ev[-1].time_range.end - ev[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in ev)
    idle = sum(g for g, _, _ in gaps if g > 0)
    print(f"span {span / steps:.1f} us/step, kernel+copy time {busy / steps:.1f}, idle {idle / steps:.1f} us/step")
    big = collections.defaultdict(float)
    for g, a, b in gaps:
        if g > 0:
            big[(a[:60], b[:60])] += g
    for (a, b), g in sorted(big.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  idle {g / steps:7.1f} us/step after {a} before {b}")


if __name__ == "__main__":
    main()

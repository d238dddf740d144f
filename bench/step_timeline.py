"""Where a decode step's GPU time goes, on the kernel timeline (a diagnostic for the LoRA side path).

    python -m bench.step_timeline [--adapters 0,8,64] [--steps 4] [--out FILE] [--tiny]

For each adapter count: 64 requests (`--batch`) decoding on the seed shape, synchronous steps that
replay the decode graph, profiled with torch.profiler (CUPTI sees the kernels inside a graph).
Kernels are told apart by name, not stream (a replayed graph reports each branch as a stream of its
own): the LoRA kernels (`_lora_` in the name) and the delta's memsets (bf16/fp16 fills) are the side
path, everything else (the GEMMs, the attention, the row kernels) the main path; main-path kernels
may overlap one another, so a gap is idle time after the latest end so far. Host-device copies bracket each
step; only the kernels between them count, so the host's time between synchronous steps is left
out. Per step:
- span: first kernel start to last kernel end;
- main_busy: main-path kernel time; gaps: the main path idle between two of its kernels;
- side_wait: the part of those gaps that ends after a LoRA kernel ends inside it (the main path
  waited for the LoRA: the join), the rest is launch and dependency latency;
- side_busy and side_hidden: LoRA kernel time, and how much of it overlapped main-path kernels.
The largest gaps are listed with the kernels around them. Raw events go to the JSON (`--out`).
`--tiny` runs the demo shape on CPU, where there are no device kernels: it only checks the script.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.engine_build import build_engine, register_random_adapters
from bench.engine_workload import adapter_sets, start_decode, sync


def device_events(prof) -> list[dict]:
    """Kernels and memsets on the device: name, stream, start and end in µs."""
    out = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.time_range.elapsed_us() <= 0:
            continue
        out.append({"name": ev.name, "stream": ev.device_resource_id, "start": ev.time_range.start,
                    "end": ev.time_range.end})
    return sorted(out, key=lambda e: e["start"])


def busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def is_copy(event: dict) -> bool:
    return event["name"].startswith("Memcpy")


def is_side(event: dict) -> bool:
    """The LoRA side path: its Triton kernels, and the memsets of its delta buffers (fills in the
    activation dtype, bf16 or fp16 here; the main path has none in a decode step)."""
    name = event["name"]
    return "_lora_" in name or "FillFunctor<c10::BFloat16>" in name or "FillFunctor<c10::Half>" in name


def step_segments(events: list[dict]) -> list[list[dict]]:
    """The kernels between host-device copies (one decode step's replay each), in time order."""
    segments, cur = [], []
    for e in events:
        if is_copy(e):
            if cur:
                segments.append(cur)
            cur = []
        else:
            cur.append(e)
    return segments + [cur] if cur else segments


def analyse(events: list[dict], steps: int, top: int = 8) -> dict:
    if not events:
        return {"note": "no device kernels recorded (CPU run)"}
    segments = step_segments(events)
    gaps, side_wait = [], 0.0
    span = main_busy = side_busy = side_hidden = 0.0
    main_all, side_all = [], []
    for seg in segments:
        main = [e for e in seg if not is_side(e)]
        side = [e for e in seg if is_side(e)]
        main_all += main
        side_all += side
        busy_until, last = None, None  # the main path is busy until the latest end so far (kernels overlap)
        for nxt in main:
            if busy_until is not None and nxt["start"] > busy_until:
                gap = nxt["start"] - busy_until
                ends = [s["end"] for s in side if busy_until < s["end"] <= nxt["start"]]
                waited = (max(ends) - busy_until) if ends else 0.0
                side_wait += waited
                gaps.append({"us": round(gap, 2), "waited_for_side_us": round(waited, 2),
                             "after": last["name"][:60], "before": nxt["name"][:60]})
            if busy_until is None or nxt["end"] > busy_until:
                busy_until, last = nxt["end"], nxt
        main_iv = [(e["start"], e["end"]) for e in main]
        side_iv = [(e["start"], e["end"]) for e in side]
        span += max(e["end"] for e in seg) - seg[0]["start"]
        seg_main, seg_side = busy(main_iv), busy(side_iv)
        main_busy += seg_main
        side_busy += seg_side
        side_hidden += seg_side + seg_main - busy(main_iv + side_iv)
    return {
        "span_ms": round(span / 1e3 / steps, 3),
        "main_busy_ms": round(main_busy / 1e3 / steps, 3),
        "gaps_ms": round(sum(g["us"] for g in gaps) / 1e3 / steps, 3),
        "side_wait_ms": round(side_wait / 1e3 / steps, 3),
        "side_busy_ms": round(side_busy / 1e3 / steps, 3),
        "side_hidden_ms": round(side_hidden / 1e3 / steps, 3),
        "main_kernels_per_step": round(len(main_all) / steps),
        "side_kernels_per_step": round(len(side_all) / steps),
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
        "main_kernels_us": by_name(main_all, steps, top),
        "side_kernels_us": by_name(side_all, steps, top),
    }


def by_name(events: list[dict], steps: int, top: int) -> dict[str, float]:
    """Kernel time per step by kernel name (first 60 characters), largest first."""
    total: dict[str, float] = {}
    for e in events:
        total[e["name"][:60]] = total.get(e["name"][:60], 0.0) + e["end"] - e["start"]
    return {k: round(v / steps, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", default="0,8,64")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/step-timeline-h200.json "
                                                             "(--tiny: /tmp/step-timeline-tiny.json)")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    device = "cpu" if args.tiny else "cuda"
    counts = [int(x) for x in args.adapters.split(",") if x]
    bargs = argparse.Namespace(tiny=args.tiny, rank=16, batch=args.batch, modes="graphs")
    engine, model_config, _ = build_engine(bargs, device, max(counts + [1]))
    names = register_random_adapters(engine, model_config, max(counts + [1]), 16)
    engine.async_steps.enabled = False  # one step at a time: each profiled step is one replay
    rows = []
    for d in counts:
        start_decode(engine, adapter_sets(names, d, args.batch), args.prompt_len, 3 * args.steps + 8)
        for _ in range(2):
            engine.step()  # capture (first use of this chunk class), then a plain replay
        sync()
        activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                engine.step()
            sync()
        events = device_events(prof)
        row = {"adapters": d, **analyse(events, args.steps), "events": events}
        rows.append(row)
        summary = {k: v for k, v in row.items() if k not in ("events", "largest_gaps", "main_kernels_us",
                                                                 "side_kernels_us")}
        print(f"{d} adapters: {summary}", flush=True)
        for stream in ("main", "side"):
            for name, us in row.get(f"{stream}_kernels_us", {}).items():
                print(f"    {stream} {us:8.1f} us/step  {name}")
        for g in row.get("largest_gaps", []):
            print(f"    gap {g['us']:7.2f} us (waited for side {g['waited_for_side_us']:6.2f}) "
                  f"after {g['after']} / before {g['before']}")
        while engine.has_unfinished():
            engine.step()
    out = args.out or Path("/tmp/step-timeline-tiny.json" if args.tiny else "bench/results/step-timeline-h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny)",
                               "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

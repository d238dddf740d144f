"""Where a decode step's time goes (bench/engine.py --breakdown, and its TTFT profiles).

step_breakdown(): the GPU kernels of a few eager steps under torch.profiler, summed per class (base
matmuls, LoRA, attention, other) by kernel name; the graph replay alone (CUDA events); the whole
step (host included), synchronous and async. profiled() is the kernel-class sum around any run,
host_profile() a cProfile of one.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.engine_workload import start_decode, sync
from lorafleet.worker.engine.engine import LLMEngine

KERNEL_CLASSES = (  # (class, substrings of CUDA kernel names), first match wins
    ("lora", ("_lora_shrink", "_lora_expand")),
    ("attention", ("paged", "attention", "attn", "flash", "fmha", "sdpa")),
    ("base matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profiled(engine: LLMEngine, run, steps: int) -> dict:
    """Kernel time per step by class while `run()` does `steps` steps (CPU op time on CPU: smoke)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    sync()
    t0 = time.perf_counter()
    with profile(activities=[activity]) as prof:
        run()
        sync()
    wall = time.perf_counter() - t0
    per_class = {cls: 0.0 for cls, _ in KERNEL_CLASSES} | {"other": 0.0}
    launches = 0
    for avg in prof.key_averages():
        us = avg.self_device_time_total if activity == ProfilerActivity.CUDA else avg.self_cpu_time_total
        if us > 0:
            per_class[kernel_class(avg.key)] += us
            launches += avg.count
    result = {f"{cls}_ms": round(us / 1e3 / steps, 3) for cls, us in per_class.items()}
    result["kernels_ms"] = round(sum(per_class.values()) / 1e3 / steps, 3)
    result["launches_per_step"] = round(launches / steps)
    result["profiled_wall_ms"] = round(wall * 1e3 / steps, 3)
    return result


def host_profile(run, top: int = 14) -> list[str]:
    """cProfile of `run()`: the `top` functions by cumulative time, as 'ms  calls  function' lines."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    run()
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:top]  # (cc, nc, tt, ct, callers)
    return [f"{ct * 1e3:8.2f} ms {nc:6d}  {Path(f).name}:{line}({fn})" for (f, line, fn), (_cc, nc, _tt, ct, _c) in rows]


def step_breakdown(engine: LLMEngine, adapter_sets, prompt_len: int, steps: int = 6) -> dict:
    """Per decode step: GPU kernel time by class (eager, profiled), graph replay alone, whole step."""
    graphs = engine.runner.graphs
    start_decode(engine, adapter_sets, prompt_len, 5 * steps + 8)
    if graphs is not None:
        graphs.enabled = False
    engine.step()
    sync()
    result = profiled(engine, lambda: [engine.step() for _ in range(steps)], steps)
    if graphs is not None and graphs.capture:
        graphs.enabled = True
        for _ in range(2):
            engine.step()  # capture, then a plain replay
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        result["graph_step_ms"] = round((time.perf_counter() - t0) * 1e3 / steps, 3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):  # same inputs again: rewrites the same K/V, so harmless
            graphs.last.graph.replay()
        end.record()
        sync()
        result["graph_replay_ms"] = round(start.elapsed_time(end) / steps, 3)
        result["host_ms"] = round(result["graph_step_ms"] - result["graph_replay_ms"], 3)
        engine.async_steps.enabled = True  # the same steps pipelined: host work behind the GPU's
        engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        engine.async_steps.enabled = False
        result["async_step_ms"] = round((time.perf_counter() - t0) * 1e3 / steps, 3)
    while engine.has_unfinished():
        engine.step()
    return result

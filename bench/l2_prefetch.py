"""Does a bulk L2 prefetch of the adapters' weights make the LoRA launches behind it faster? (H200)

    python -m bench.l2_prefetch [--out bench/results/l2-prefetch-h200.json]

For each case (module shape, tokens, distinct rank-16 adapters, what is prefetched), µs of the
shrink + expand pair (`add_lora_triton`, CUDA events, median of the repeats), each after L2 was
flushed (a 256 MiB write), then:
- cold: nothing else;
- prefetched: `launch_lora_prefetch`, then ~30 µs of an idle kernel (the lines land), then the pair;
- prefetched, then streamed: the same with a read of 48 MiB between (a decode attention's K/V at
  batch 64, 128-token prompts, one layer), to see whether the evict-last lines survive it;
- warm: the pair run twice, the second timed (everything it reads in L2: the best a prefetch can do).
Each is a CUDA graph of the sequence minus a graph of the sequence without the timed pair.
The engine's answer is `python -m bench.overlap_sweep --variants 52,53,54`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lorafleet.kernels.l2_prefetch import launch_lora_prefetch
from lorafleet.kernels.lora_ops import add_lora_reference, build_lora_meta, new_lora_b
from lorafleet.kernels.triton_lora import add_lora_triton

SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
          "down": (14336, [4096])}
CASES = [("o", 64, 64, "ab"), ("o", 64, 8, "ab"), ("qkv", 64, 64, "ab"), ("gate_up", 64, 64, "a"),
         ("gate_up", 64, 64, "ab"), ("down", 64, 64, "ab")]


def _setup(module: str, tokens: int, adapters: int, rank: int = 16, slots: int = 64):
    dev, dt = "cuda", torch.bfloat16
    in_f, outs = SHAPES[module]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(tokens, in_f, generator=g) * 0.5).to(dev, dt)
    lora_a = [(torch.randn(slots, rank, in_f, generator=g) * 0.02).to(dev, dt) for _ in outs]
    lora_b = []
    for out in outs:
        b = new_lora_b(slots, out, rank, device=dev, dtype=dt)
        b.copy_((torch.randn(slots, out, rank, generator=g) * 0.02).to(dev, dt))
        lora_b.append(b)
    ranks = [[rank] * slots for _ in outs]
    ranks_device = torch.tensor(ranks, dtype=torch.int32, device=dev)
    token_slots = (torch.arange(tokens) % adapters).view(tokens, 1).to(torch.int32)
    meta = build_lora_meta(token_slots, torch.ones(tokens, 1), slots, dev)
    meta.launch_chunks, meta.rank_bound = meta.num_chunks, rank
    y = torch.zeros(tokens, sum(outs), device=dev, dtype=dt)
    return x, lora_a, lora_b, ranks, ranks_device, meta, y


def _graph(fns) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:  # warm-up outside the capture (Triton compiles, the allocator settles)
            fn()
        with torch.cuda.graph(g, stream=s):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g


def _replay_us(g: torch.cuda.CUDAGraph, repeats: int, groups: int = 7) -> float:
    """Median over groups of the mean µs a replay (launch latency hidden: replays queue back to back)."""
    times = []
    for _ in range(groups):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeats)
    return statistics.median(times)


def _time(before, fn, repeats: int) -> float:
    """µs of fn behind `before`: a graph of both minus a graph of `before` alone."""
    return _replay_us(_graph([before, fn]), repeats) - _replay_us(_graph([before]), repeats)


def _case(module: str, tokens: int, adapters: int, parts: str, repeats: int, flush_buf: torch.Tensor,
          stream_buf: torch.Tensor, idle_cycles: int) -> dict:
    x, a, b, ranks, ranks_d, meta, y = _setup(module, tokens, adapters)
    ref = torch.zeros_like(y)
    add_lora_reference(ref, x, a, b, ranks, meta)

    def pair() -> None:
        add_lora_triton(y, x, a, b, ranks_d, meta)

    def flush() -> None:
        flush_buf.zero_()

    def prefetched() -> None:
        flush()
        launch_lora_prefetch(a, b, ranks_d, meta, parts)
        torch.cuda._sleep(idle_cycles)

    def streamed() -> None:
        prefetched()
        stream_buf.sum()

    pair()
    launch_lora_prefetch(a, b, ranks_d, meta, parts)  # changes nothing the pair computes
    y.zero_()
    pair()
    torch.cuda.synchronize()
    rel = float((y.float() - ref.float()).norm() / ref.float().norm())
    row = {"module": module, "tokens": tokens, "adapters": adapters, "prefetch": parts, "rel_err": round(rel, 5)}
    for name, before in (("cold_us", flush), ("prefetched_us", prefetched), ("streamed_us", streamed),
                         ("warm_us", pair)):
        row[name] = round(_time(before, pair, repeats), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench/results/l2-prefetch-h200.json"))
    args = ap.parse_args()
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stream_buf = torch.ones(24 << 20, dtype=torch.bfloat16, device="cuda")  # 48 MiB
    cycles_30us = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 30e-6) if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 60_000
    rows = []
    for case in CASES:
        rows.append(_case(*case, args.repeats, flush_buf, stream_buf, cycles_30us))
        print(rows[-1], flush=True)
    print(f"\n{'module':<8} {'T':>3} {'adapters':>8} {'prefetch':>8} {'cold':>7} {'prefetched':>10} {'+48MiB':>7} {'warm':>7}")
    for r in rows:
        print(f"{r['module']:<8} {r['tokens']:>3} {r['adapters']:>8} {r['prefetch']:>8} {r['cold_us']:>7} "
              f"{r['prefetched_us']:>10} {r['streamed_us']:>7} {r['warm_us']:>7}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Prefill steps: a burst of fresh prompts, and one prompt joining a running decode batch.

    python -m bench.prefill [--tiny] [--batch 64] [--prompt-lens 16,32,128,512] [--repeats 5]

Two timings per prompt length, each the median of `--repeats` (host clock around `engine.step()`
calls, synchronised on CUDA):
- burst: `--batch` fresh prompts submitted at once, until every one has its first token (the
  prefill steps, chunked by max_num_batched_tokens, then one sampled token each);
- join: `--batch - 1` requests decoding, one fresh prompt added; the steps until it has its first
  token. Those steps are mixed: the prompt's chunk plus a decode row per running request, and
  prefill attention handles every row of them.
First, one 512-token prompt's time to first token as the process's first request, then again.
Every prompt is new to the prefix cache (`bench.engine_workload.fresh_prompt`). `--tiny`: the demo-sized
shape on CPU (what CI machines can run); without it the seed shape on CUDA, as bench/engine.py
builds it. Writes bench/results/prefill-{cpu,cuda}.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.engine_build import build_engine
from bench.engine_workload import fresh_prompt, sync, ttft
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams


def join(engine: LLMEngine, batch: int, prompt_len: int) -> float:
    running = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(fresh_prompt(engine, 16), running) for _ in range(batch - 1)]
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    engine.drain()
    new = engine.add_request(fresh_prompt(engine, prompt_len), SamplingParams(max_tokens=1, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    done = False
    while not done:
        done = any(out.request_id == new and out.new_token_ids for out in engine.step())
    sync()
    elapsed = (time.perf_counter() - t0) * 1e3
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the demo-sized shape on CPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-lens", default="16,32,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    args.rank, args.modes = 16, "graphs"  # what build_engine reads
    engine, _config, _ = build_engine(args, device, 1)
    engine.async_steps.enabled = False  # time the steps themselves
    hits0 = engine.blocks.prefix_hits
    # The process's first long prefill, before anything else ran at that shape (what a freshly
    # started worker's first request pays: the engine does no warm-up prefill), then a warm one.
    cold = ttft(engine, 512)
    warm = ttft(engine, 512)
    print(f"one 512-token prompt: first in the process {cold:.2f} ms, then {warm:.2f} ms", flush=True)
    rows = []
    for plen in (int(x) for x in args.prompt_lens.split(",") if x):
        ttft(engine, plen, args.batch)  # warm-up at this shape
        join(engine, args.batch, plen)
        b = [ttft(engine, plen, args.batch) for _ in range(args.repeats)]  # the burst
        j = [join(engine, args.batch, plen) for _ in range(args.repeats)]
        rows.append({"prompt_len": plen, "batch": args.batch, "burst_ms": round(statistics.median(b), 2),
                     "burst_ms_min": round(min(b), 2), "join_ms": round(statistics.median(j), 2),
                     "join_ms_min": round(min(j), 2)})
        r = rows[-1]
        print(f"prompt {plen:>5}: burst of {args.batch} {r['burst_ms']:>9.2f} ms   join a batch of {args.batch - 1} "
              f"decodes {r['join_ms']:>8.2f} ms", flush=True)
    if engine.blocks.prefix_hits != hits0:
        raise RuntimeError("a prompt hit the prefix cache")
    out = args.out or Path(__file__).parent / "results" / f"prefill-{device}.json"
    machine = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"
    result = {"machine": machine, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "shape": "tiny (demo-sized, CPU)" if args.tiny else "seed 7.8B (bf16)",
              "ttft_512_first_ms": round(cold, 2), "ttft_512_then_ms": round(warm, 2), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

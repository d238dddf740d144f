"""Where a decode step's time goes at the seed shape (GPU): torch.profiler over a few steps.

    python bench/profile_engine.py [--adapters 8] [--batch 64] [--prompt-len 128]

Prints the top operators by device time and by host time, and the step time with and without
the profiler. A tool for issue 9's work, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.engine import SEED_SHAPE, random_adapter, random_weights, sync
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.demo_assets import build_tokenizer
from lorafleet.worker.engine import LLMEngine
from lorafleet.worker.sequence import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(SEED_SHAPE))
    build_tokenizer(folder)
    mc = ModelConfig.from_folder(folder)
    cfg = EngineConfig(max_loras=max(args.adapters, 1), max_cpu_loras=max(args.adapters, 1) + 4, max_lora_rank=16,
                       max_num_seqs=args.batch, max_num_batched_tokens=8192, device="cuda", dtype="bfloat16",
                       max_loras_per_request=1)
    engine = LLMEngine(folder, cfg, weights=random_weights(mc, "cuda"))
    names = [f"a{k}" for k in range(args.adapters)]
    for k, n in enumerate(names):
        engine.registry.register(n, random_adapter(mc, 16, seed=k))
    sp = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for r in range(args.batch):
        adapters = ((names[r % len(names)], 1.0),) if names else ()
        engine.add_request([(r * 7919 + j * 31) % 90000 + 10 for j in range(args.prompt_len)], sp, adapters)
    for _ in range(12):  # prefill + warm decode steps
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    plain_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(f"decode step: {plain_ms:.2f} ms at batch {args.batch}, {args.adapters} adapters "
          f"({args.batch / plain_ms * 1e3:,.0f} tok/s)")
    table_dev = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table_dev)
    print(table_cpu)
    if args.out:
        args.out.write_text(table_dev + "\n\n" + table_cpu)


if __name__ == "__main__":
    main()

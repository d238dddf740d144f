"""Decode speed of the engine on CPU with the demo model: batch 8, mixed adapters.

    python bench/engine_cpu.py [--assets DIR] [--threads 2]

Prints a table and writes bench/results/engine-cpu.json. Target (issue 2): >= 50 decode tokens/s
per request at batch 8 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.demo_assets import DEMO_ADAPTERS, make_demo_assets
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

WORKLOADS = {
    "base-only": lambda names: [()] * 8,
    "1 adapter": lambda names: [((names[0], 1.0),)] * 8,
    "4 adapters": lambda names: [((names[i % 4], 1.0),) for i in range(8)],
    "4 adapters + base + composed": lambda names: [((names[i], 1.0),) for i in range(4)]
    + [(), (), ((names[0], 0.5), (names[1], 0.5)), ((names[2], 1.0),)],
}


def run(engine: LLMEngine, adapters, prompt_len: int, new_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 400 + 10 for j in range(prompt_len)] for i in range(len(adapters))]
    for p, a in zip(prompts, adapters):
        engine.add_request(p, sp, a)
    step_times, batch_sizes = [], []
    t_start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if len(engine.scheduler.running) == len(adapters) and all(o.num_generated > 1 for o in outs):
            step_times.append(dt)
            batch_sizes.append(len(outs))
    total = time.perf_counter() - t_start
    step = statistics.median(step_times)
    return {
        "batch": len(adapters),
        "decode_step_ms": round(step * 1e3, 3),
        "tokens_per_s_per_request": round(1.0 / step, 1),
        "decode_tokens_per_s": round(len(adapters) / step, 1),
        "wall_s": round(total, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assets = make_demo_assets(args.assets or Path(tempfile.gettempdir()) / "lorafleet-demo-assets")
    names = [a.name for a in DEMO_ADAPTERS]
    engine = LLMEngine(assets / "model", EngineConfig(max_loras=8, max_cpu_loras=8),
                       lora_modules={n: str(assets / "adapters" / n) for n in names})
    run(engine, WORKLOADS["base-only"](names), 32, 8)  # warm-up
    rows = []
    for name, make in WORKLOADS.items():
        # Best of three runs: the machine is shared, and interference only ever slows a run down.
        runs = [run(engine, make(names), prompt_len=32, new_tokens=args.new_tokens) for _ in range(3)]
        rows.append({"workload": name, **min(runs, key=lambda r: r["decode_step_ms"])})
    header = f"{'workload':<30} {'batch':>5} {'step ms':>8} {'tok/s/req':>10} {'tok/s':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['workload']:<30} {r['batch']:>5} {r['decode_step_ms']:>8} {r['tokens_per_s_per_request']:>10} {r['decode_tokens_per_s']:>8}")
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
                    "torch": torch.__version__},
        "model": "demo (2 layers, hidden 64, vocab 512), fp32",
        "target_tokens_per_s_per_request": 50,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

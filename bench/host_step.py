"""Host time of a decode step, the model stubbed out (CPU): what the GPU waits for between replays.

    python -m bench.host_step [--batch 64] [--adapters 0,8,64] [--steps 200] [--profile]

The engine runs its CUDA-graph path on static buffers (no capture on CPU) at a tiny model shape,
with `DecodeGraphs._forward` replaced by a function that returns constant logits and their greedy
picks (what a graph ends with), so a step's time is the host's own work: scheduling, the padded
inputs, the LoRA metadata, buffer fills, taking the picks (greedy, a 1,000-token vocab),
bookkeeping and detokenization. On the H200 the same work measured
1.2 ms (base-only) to 2.5 ms (64 adapters) per step (bench/engine.py --breakdown, docs/benchmarks-history.md);
this script tracks its parts where they can be changed and timed without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_build import TINY_SHAPE, random_adapter, random_weights
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.demo_assets import build_tokenizer
from lorafleet.worker.engine.cuda_graphs import DecodeOutput
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams


def stub_engine(batch: int, adapters: int) -> LLMEngine:
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY_SHAPE))
    build_tokenizer(folder)
    mc = ModelConfig.from_folder(folder)
    config = EngineConfig(max_loras=max(adapters, 1), max_cpu_loras=adapters + 4, max_lora_rank=16, max_num_seqs=batch,
                          device="cpu", dtype="float32", num_kv_blocks=4096, cuda_graphs=True)
    engine = LLMEngine(folder, config, weights=random_weights(mc, "cpu"))
    for k in range(adapters):
        engine.registry.register(f"a{k}", random_adapter(mc, 16, seed=k))
    graphs = engine.runner.graphs
    logits = torch.zeros(graphs.buckets[-1], mc.vocab_size)
    logits[:, 7] = 1.0
    picks = torch.full((graphs.buckets[-1],), 7, dtype=torch.int64)
    # the model and the graph's greedy pick, stubbed
    graphs._forward = lambda captured: DecodeOutput(logits[: captured.bucket], (picks[: captured.bucket],) * 2)
    sp = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    for r in range(batch):
        ads = ((f"a{r % adapters}", 1.0),) if adapters else ()
        engine.add_request([(r * 7919 + j * 31) % 900 + 10 for j in range(128)], sp, ads)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", default="0,8,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile the steps of the last adapter count")
    args = ap.parse_args()
    rows = []
    for d in (int(x) for x in args.adapters.split(",")):
        engine = stub_engine(args.batch, d)
        for _ in range(10):
            engine.step()
        prof = cProfile.Profile() if args.profile else None
        times = []
        for _ in range(args.steps):
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            if prof:
                prof.disable()
        times.sort()
        rows.append({"adapters": d, "batch": args.batch, "host_ms_median": round(1e3 * times[len(times) // 2], 3),
                     "host_ms_p90": round(1e3 * times[int(len(times) * 0.9)], 3)})
        print(rows[-1], flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()

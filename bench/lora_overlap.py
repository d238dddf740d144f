"""How much of the LoRA side path hides behind the base GEMM, per projection, on the GPU.

    python -m bench.lora_overlap [--tokens 64] [--adapters 1,8,64] [--out FILE]

For each module of the seed shape (qkv, o, gate_up, down), `--tokens` decode tokens spread over
each adapter count (rank 16), every variant captured in a CUDA graph over rotating copies of the
weights (as `bench/kernels.py` times), µs per call:
- gemm: the base GEMM alone;
- lora: `add_lora_triton` alone (shrink + expand);
- serial: the GEMM, then the LoRA added into its output (what the engine does above
  `SidePath.overlap_max_chunks`);
- beside: `linear_lora_deferred` with a side stream, its expand adding into a zeroed delta: zero a
  delta, shrink and expand into it on the side stream while the GEMM runs, then join;
- beside_store: the same with the storing expand (`SidePath.delta_store`, what the engine does with
  one adapter per token): nothing zeroes the delta;
- fork_join: the same fork and join with only the delta's zeroing on the side stream.
hidden = (gemm + lora - beside) / lora: the share of the LoRA's time the overlap saves.
Each variant passes its `SidePath` to `linear_lora_deferred` (the process's, beside at every chunk
count, with the carveout given).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.graph_timing import DEVICE, time_graph
from bench.kernel_cases import DTYPE, MODULES, Case, make_case_inputs
from lorafleet.kernels.lora.launch import add_lora_triton
from lorafleet.kernels.lora.linear import SIDE_PATH, SidePath, gemm_sm_carveout, linear_lora_deferred
from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.worker.engine.cuda_graphs import chunk_class


def fork_join(x: torch.Tensor, out: int, side: torch.cuda.Stream, base) -> torch.Tensor:
    delta = torch.empty((x.shape[0], out), dtype=x.dtype, device=x.device)
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        delta.zero_()
    y = base()
    main.wait_stream(side)
    return y


def run(module: str, tokens: int, adapters: int, side: torch.cuda.Stream, g: torch.Generator,
        side_path: SidePath) -> dict:
    d_in, outs = MODULES[module]
    case = Case(module, tokens, adapters, 16, 16)
    sets, token_slots, token_scales, ranks = make_case_inputs(case, g)
    sets = sets[:4]
    weights = [torch.randn(sum(outs), d_in, device=DEVICE, dtype=DTYPE) / d_in**0.5 for _ in range(3)]
    meta = build_lora_meta(token_slots, token_scales, adapters, DEVICE)
    meta.rank_bound = 16  # as a decode graph launches (bench/kernel_runner.py run_case)
    meta.launch_chunks = chunk_class(meta.num_chunks, meta.max_chunks)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)

    def calls(body):
        return [lambda s=s, w=weights[i % len(weights)]: body(s, w) for i, s in enumerate(sets * 3)]

    def gemm(s, w):
        with gemm_sm_carveout(side_path.carveout[0]):  # what the GEMM beside the LoRA runs with
            return F.linear(s.x, w)

    def lora(s, w):
        add_lora_triton(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta)

    def serial(s, w):
        y = F.linear(s.x, w)
        add_lora_triton(y, s.x, s.lora_a, s.lora_b, ranks_dev, meta)

    def beside_with(store: bool):
        settings = replace(side_path, delta_store=(store, store))

        def body(s, w):
            y, delta = linear_lora_deferred(lambda: F.linear(s.x, w), s.x, s.lora_a, s.lora_b, ranks, ranks_dev,
                                            meta, "triton", side, settings)
            assert delta is not None
        return body

    def fj(s, w):
        fork_join(s.x, sum(outs), side, lambda: F.linear(s.x, w))

    row = {"module": module, "tokens": tokens, "adapters": adapters}
    for name, body in (("gemm", gemm), ("lora", lora), ("serial", serial), ("beside", beside_with(False)),
                       ("beside_store", beside_with(True)), ("fork_join", fj)):
        row[f"{name}_us"] = round(time_graph(calls(body)), 2)
    row["hidden"] = round((row["gemm_us"] + row["lora_us"] - row["beside_us"]) / row["lora_us"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", default="1,8,64")
    ap.add_argument("--carveouts", default="0", help="SMs the GEMM beside the LoRA leaves free (SidePath.carveout)")
    ap.add_argument("--blas", default="default", help="comma-separated: default, cublaslt (preferred_blas_library)")
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora-overlap-h200.json"))
    args = ap.parse_args()
    side = torch.cuda.Stream()
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'blas':<8} {'carve':>5} {'module':<8} {'adapters':>8} {'gemm':>8} {'lora':>8} {'serial':>8} {'beside':>8} "
          f"{'b_store':>8} {'fork_join':>9} {'hidden':>7}")
    for blas in args.blas.split(","):
        torch.backends.cuda.preferred_blas_library("cublas" if blas == "default" else blas)
        for carveout in (int(x) for x in args.carveouts.split(",")):
            # beside at every adapter count here, with this carveout
            side_path = replace(SIDE_PATH, overlap_max_chunks=1 << 30, carveout=(carveout,) * 4)
            for module in args.modules.split(","):
                for d in (int(x) for x in args.adapters.split(",") if x):
                    r = {"blas": blas, "carveout": carveout, **run(module, args.tokens, d, side, g, side_path)}
                    rows.append(r)
                    print(f"{blas:<8} {carveout:>5} {module:<8} {d:>8} {r['gemm_us']:>8} {r['lora_us']:>8} "
                          f"{r['serial_us']:>8} {r['beside_us']:>8} {r['beside_store_us']:>8} {r['fork_join_us']:>9} "
                          f"{r['hidden']:>7}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Benchmark the Triton paged decode attention against the engine's torch path and the memory floor.

    python bench/attention.py [--out bench/results/attention-h200.json] [--sweep] [--max-model-len 2048]
    python bench/attention.py --tiny          # CPU smoke run in the Triton interpreter; writes nothing

The seed model's attention (H=32 query heads, KVH=8 KV heads, D=128), bf16, batch 64, KV blocks of 16
tokens in shuffled order; every sequence at context 128, 512 or 2048, plus a mixed batch (lengths
uniform in 1..max_model_len). Each row:

- triton_us: `paged_decode_attention`, block tables as wide as the longest context.
- graph_us: the same with tables as wide as `--max-model-len` (the shape a CUDA graph of a decode
  bucket is captured at: programs past a sequence's length exit, the launch config may differ).
- torch_us: the engine's torch path (`decode_attention(..., "torch", max_context)`: gather the blocks
  into a padded tensor, then SDPA).
- floor_us: bytes the op must move (K and V of every context token once, q read, out written) over
  the device-to-device copy bandwidth measured in this run; bw_frac = floor_us / triton_us.

Timing: each op is captured in a CUDA graph (as the engine's decode step will be) and replayed by
`triton.testing.do_bench`, which clears L2 before every replay; median µs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


SEED = Shape(batch=64, heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
TINY = Shape(batch=2, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)


@dataclass(slots=True)
class Case:
    """One decode step's inputs; `tables` is as wide as `width` blocks."""

    name: str
    lens: list[int]
    q: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, width] int32
    lens_t: torch.Tensor  # [B] int32


def make_case(name: str, lens: list[int], shape: Shape, width: int, device: str, g: torch.Generator) -> Case:
    """Each sequence owns its own blocks, drawn from a shuffled pool (no two share a block)."""
    per_seq = [math.ceil(n / shape.block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    pool = torch.randperm(num_blocks, generator=g)
    tables = torch.full((shape.batch, width), int(pool[-1]), dtype=torch.int32)
    taken = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = pool[taken : taken + n].to(torch.int32)
        taken += n
    cache_shape = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    q = torch.randn(shape.batch, shape.heads, shape.head_dim, device=device, dtype=shape.dtype)
    return Case(name, lens, q, k_cache, v_cache, tables.to(device),
                torch.tensor(lens, dtype=torch.int32, device=device))


def widen(case: Case, width: int) -> Case:
    """The same step with tables padded to `width` blocks (padding points at an unused block)."""
    extra = case.tables[:, -1:].expand(-1, width - case.tables.shape[1])
    return Case(case.name, case.lens, case.q, case.k_cache, case.v_cache,
                torch.cat([case.tables, extra], dim=1).contiguous(), case.lens_t)


def bytes_moved(case: Case) -> int:
    _nb, _bs, kv_heads, head_dim = case.k_cache.shape
    elem = case.q.element_size()
    kv = 2 * sum(case.lens) * kv_heads * head_dim * elem
    return kv + 2 * case.q.numel() * elem + case.tables.numel() * 4


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    from triton.testing import do_bench

    n = 2**30 // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3)


def time_us(call: Callable[[], object], device: str) -> float:
    """Median µs of `call`: a CUDA graph replayed by do_bench on the GPU; wall clock on CPU."""
    if device != "cuda":
        call()
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile and allocate outside the capture
        call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    del graph
    return ms * 1e3


def run_case(case: Case, graph_width: int, bandwidth: float | None, device: str, sweep: bool) -> dict:
    from lorafleet.kernels.attention.paged_attention import (
        DecodeConfig,
        paged_decode_attention,
        paged_decode_attention_reference,
        pick_config,
    )
    from lorafleet.worker.layers.attention import decode_attention

    scale = case.q.shape[-1] ** -0.5
    batch, heads, head_dim = case.q.shape
    block_size, kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    max_ctx = max(case.lens)
    out = torch.empty_like(case.q)

    def triton_call(c: Case, config: DecodeConfig | None = None) -> Callable[[], object]:
        return lambda: paged_decode_attention(c.q, c.k_cache, c.v_cache, c.tables, c.lens_t, scale, out=out,
                                              config=config)

    ref = paged_decode_attention_reference(case.q, case.k_cache, case.v_cache, case.tables, case.lens_t, scale)
    triton_call(case)()
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    dev = torch.device(device)
    row: dict = {
        "case": case.name,
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": str(case.q.dtype).removeprefix("torch."),
        "max_context": max_ctx,
        "mean_context": sum(case.lens) / len(case.lens),
        "bytes": bytes_moved(case),
        "config": asdict(pick_config(batch, kv_heads, case.tables.shape[1], block_size, head_dim, dev)),
        "triton_us": round(time_us(triton_call(case), device), 2),
        "rel_err": err,
    }
    graph_case = widen(case, graph_width) if graph_width > case.tables.shape[1] else case
    row["graph_width_blocks"] = graph_case.tables.shape[1]
    row["graph_config"] = asdict(pick_config(batch, kv_heads, graph_width, block_size, head_dim, dev))
    row["graph_us"] = round(time_us(triton_call(graph_case), device), 2)
    row["torch_us"] = round(time_us(
        lambda: decode_attention(case.q, case.k_cache, case.v_cache, case.tables, case.lens_t, scale, "torch",
                                 max_context=max_ctx), device), 2)
    row["floor_us"] = None if bandwidth is None else round(row["bytes"] / bandwidth * 1e6, 2)
    row["bw_frac"] = None if bandwidth is None else round(row["floor_us"] / row["triton_us"], 3)
    row["speedup_vs_torch"] = round(row["torch_us"] / row["triton_us"], 2)
    if sweep:
        timings = []
        for block_n in (32, 64, 128):
            for splits in (1, 2, 4, 8, 16):
                for warps in (4, 8):
                    for stages in (1, 2, 3):
                        config = DecodeConfig(block_n, splits, warps, stages)
                        try:
                            us = round(time_us(triton_call(case, config), device), 2)
                        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: note it, go on
                            timings.append({**asdict(config), "us": math.inf, "error": str(exc)[:200]})
                            continue
                        timings.append({**asdict(config), "us": us})
        row["sweep"] = sorted(timings, key=lambda t: t["us"])
        row["best"] = row["sweep"][0]
    return row


def print_table(rows: list[dict]) -> None:
    print("| case | max ctx | MiB moved | floor µs | triton µs | bw frac | graph-width µs | torch µs | × torch | "
          "config (block_n, splits) | rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        floor = "n/a" if r["floor_us"] is None else f"{r['floor_us']:.1f}"
        frac = "n/a" if r["bw_frac"] is None else f"{r['bw_frac']:.2f}"
        cfg = r["config"]
        print(f"| {r['case']} | {r['max_context']} | {r['bytes'] / 2**20:.1f} | {floor} | {r['triton_us']:.1f} | {frac} "
              f"| {r['graph_us']:.1f} | {r['torch_us']:.1f} | {r['speedup_vs_torch']:.2f} | "
              f"{cfg['block_n']}, {cfg['num_splits']} | {r['rel_err']:.1e} |")
        if "best" in r:
            b = r["best"]
            print(f"|   best swept: block_n {b['block_n']}, splits {b['num_splits']}, warps {b['num_warps']}, "
                  f"stages {b['num_stages']}: {b['us']:.1f} µs |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results file (default bench/results/attention-h200.json on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="table width of the graph-shaped rows")
    parser.add_argument("--sweep", action="store_true", help="also time launch configs per case")
    parser.add_argument("--tiny", action="store_true", help="small shapes; on CPU in the Triton interpreter")
    args = parser.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.tiny:
        print("needs a CUDA GPU (or --tiny for a CPU smoke run in the interpreter)", file=sys.stderr)
        return 2
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is imported, below
    import triton

    device = "cuda" if has_cuda else "cpu"
    shape, contexts, max_len = (TINY, [16, 40], 64) if args.tiny else (SEED, [128, 512, 2048], args.max_model_len)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth() if has_cuda else None
    if bandwidth is not None:
        print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    steps = [(f"ctx {n}", [n] * shape.batch) for n in contexts]
    steps.append((f"mixed 1..{max_len}", torch.randint(1, max_len + 1, (shape.batch,), generator=g).tolist()))
    rows = []
    for name, lens in steps:
        width = math.ceil(max(lens) / shape.block_size)
        case = make_case(name, lens, shape, width, device, g)
        rows.append(run_case(case, math.ceil(max_len / shape.block_size), bandwidth, device, args.sweep))
        r = rows[-1]
        print(f"  {name}: triton {r['triton_us']} µs, torch {r['torch_us']} µs, floor {r['floor_us']} µs, "
              f"rel err {r['rel_err']:.1e}", flush=True)
        del case
        if has_cuda:
            torch.cuda.empty_cache()
    machine = torch.cuda.get_device_name() if has_cuda else f"{platform.processor() or 'cpu'} (Triton interpreter)"
    print(f"machine {machine}, date {datetime.date.today().isoformat()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, python {platform.python_version()}"
          + ("" if bandwidth is None else f", copy bandwidth {bandwidth / 1e12:.3f} TB/s"))
    print_table(rows)
    out = args.out or (None if args.tiny else "bench/results/attention-h200.json")
    if out:
        meta = {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "triton": triton.__version__, "copy_bandwidth": bandwidth, "max_model_len": max_len}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {out}")
    if any(r["rel_err"] > 2e-2 for r in rows):
        print("the kernel disagrees with the reference (rel err > 2e-2)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

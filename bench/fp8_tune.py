"""Autotune the W8A16 FP8 GEMM on this GPU: writes its tuning file (kernels/quant/tunings/<gpu>.json).

    python -m bench fp8_tune [--rows 1,8,16,32,64,128,256] [--prefill-rows 512,2048] [--full]
                             [--out kernels/quant/tunings/<gpu>.json] [--report F]

For each of the seed shape's four projections (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336) and each decode row count, every launch config of the sweep (tiles, split-K,
warps, stages) is timed against its torch reference's result (a wrong config is skipped), and the
fastest is written under `shapes` ("NxK"); the general `decode` table takes, per row count, the
config with the least total time over the four. Above the decode sizes the three prefill paths
(the kernel with a large tile, cast-then-cuBLAS, `torch._scaled_mm`) are timed and the fastest that
keeps the kernel's accuracy (scaled_mm rounds activations to FP8 too: only with `--allow-w8a8`) is
written as `prefill`. Each timing is reported beside bf16 cuBLAS on the same shape and the FP8 byte
floor (weight bytes over the copy bandwidth measured here); `--report` writes those rows as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lorafleet.kernels.quant.fp8_linear import (
    fp8_linear_dequant,
    fp8_linear_ref,
    fp8_linear_scaled_mm,
    fp8_linear_triton,
    quantize_rows,
)
from lorafleet.kernels.quant.tuning import TUNINGS_DIR, LaunchConfig

PREFILL_TILE = LaunchConfig(max_m=1 << 20, block_m=128, block_n=128, block_k=64, warps=8, stages=3)
FIELDS = ("max_m", "block_m", "block_n", "block_k", "split_k", "warps", "stages", "swap_ab")
SEED_GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn, reps: int = 50) -> float:
    """µs per fn() as decode steps run it: `reps` calls captured in one CUDA graph, the median of 5
    replays. Timing one eager launch between two events would add the Python launch (tens of µs for a
    Triton kernel, a few for cuBLAS) to kernels that take tens of µs, and rank configs by it."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del graph
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), 10)
    return 2 * n / (us * 1e-6)


def candidates(m: int, full: bool) -> list[LaunchConfig]:
    """The sweep at m rows: the smallest M tile holding them (and 64 above 64 rows), N and K tiles,
    K splits for small m (few programs over N otherwise), warps and stages; `full` widens it."""
    bm = [max(16, min(128, 1 << (m - 1).bit_length()))] + ([64] if m > 64 else [])
    # Wider N tiles at more rows: each program reads the x tile (from L2) once per K step for its N tile.
    bn = [32, 64, 128] + ([256] if m >= 32 else [])
    bk = ([64] if full or m > 64 else []) + [128, 256]
    split = [1, 2, 4] if m <= 64 else [1]
    warps = [4, 8] if full or m > 64 else [4]
    stages = [3, 4, 5] if full else [4]
    # Swapped (W x^T)^T at up to 128 rows: the weight tile is the MMA's M side (64 or 128 rows).
    swapped = [(a, b, c, sp, w, st, True) for a, b, c, sp, w, st in
               itertools.product(bm[:1], [64, 128], [128, 256], split, [4], stages)] if m <= 128 else []
    return [LaunchConfig(max_m=m, block_m=a, block_n=b, block_k=c, split_k=sp, warps=w, stages=st, swap_ab=sw)
            for a, b, c, sp, w, st, sw in [(*p, False) for p in itertools.product(bm, bn, bk, split, warps, stages)] + swapped
            if (a * c * 2 + b * c) * st + b * c * 2 <= 227 * 1024]  # x and FP8 w tiles a stage, w in bf16 once


def tune_projection(proj: str, n: int, k: int, rows: list[int], prefill_rows: list[int], full: bool, bw: float,
                    total: dict, seen: dict) -> tuple[list[dict], list[dict]]:
    """One projection's sweep -> (report rows, its decode table); adds each config's time to total/seen."""
    report: list[dict] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, s = quantize_rows(w)
    wb = w.to(torch.bfloat16)
    del w
    table = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = fp8_linear_ref(x, q, s)
        best = None
        for c in candidates(m, full):
            try:
                y = fp8_linear_triton(x, q, s, config=c)
                if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    continue
                us = timed(lambda c=c, x=x: fp8_linear_triton(x, q, s, config=c))
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (resources) is skipped
                print(f"  skip {c}: {type(exc).__name__}", flush=True)
                continue
            total[(m, c)] = total.get((m, c), 0.0) + us
            seen[(m, c)] = seen.get((m, c), 0) + 1
            if best is None or us < best[0]:
                best = (us, c)
        if best is None:
            raise SystemExit(f"{proj} at m={m}: no launch config ran correctly")
        bf16 = timed(lambda x=x: torch.mm(x, wb.t()))
        floor = n * k / bw * 1e6
        row = {"proj": proj, "n": n, "k": k, "m": m, "fp8_us": round(best[0], 2), "bf16_cublas_us": round(bf16, 2),
               "fp8_floor_us": round(floor, 2), "of_floor": round(floor / best[0], 3), "config": repr(best[1])}
        report.append(row)
        table.append({f: getattr(best[1], f) for f in FIELDS})
        print(f"{proj:<8} m={m:>4}: fp8 {best[0]:8.1f} us (floor {floor:6.1f}, bf16 {bf16:7.1f}) {best[1]}", flush=True)
    # prefill paths
    for m in prefill_rows:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        paths = {"triton": lambda x=x: fp8_linear_triton(x, q, s, config=PREFILL_TILE),
                 "dequant": lambda x=x: fp8_linear_dequant(x, q, s),
                 "scaled_mm": lambda x=x: fp8_linear_scaled_mm(x, q, s)}
        row = {"proj": proj, "n": n, "k": k, "m": m, "bf16_cublas_us": round(timed(lambda x=x: torch.mm(x, wb.t())), 2)}
        for pname, fn in paths.items():
            try:
                row[f"{pname}_us"] = round(timed(fn, 20), 2)
            except Exception as exc:  # noqa: BLE001 - e.g. no _scaled_mm row-wise support in this torch
                row[f"{pname}_error"] = repr(exc)[:200]
        report.append(row)
        print(f"{proj:<8} prefill m={m}: {row}", flush=True)
    return report, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32,64,128,256")
    ap.add_argument("--prefill-rows", default="512,2048")
    ap.add_argument("--full", action="store_true", help="a wider sweep (3-4x the compiles and time)")
    ap.add_argument("--allow-w8a8", action="store_true", help="let scaled_mm (FP8 activations) win the prefill path")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    short = name.split()[1] if len(name.split()) > 1 else name  # "NVIDIA H100 80GB HBM3" -> H100
    bw = copy_bandwidth()
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows_list = [int(x) for x in args.rows.split(",") if x]
    t_start = time.perf_counter()
    report, shapes = [], {}
    total: dict[tuple[int, LaunchConfig], float] = {}  # (rows, config) -> µs summed over the projections
    seen: dict[tuple[int, LaunchConfig], int] = {}  # ... and over how many it ran
    out = args.out or TUNINGS_DIR / f"{short.lower()}.json"
    paths = ["triton", "dequant"] + (["scaled_mm"] if args.allow_w8a8 else [])
    for done, (proj, (n, k)) in enumerate(SEED_GEMMS.items(), 1):
        rows, table = tune_projection(proj, n, k, rows_list, [int(x) for x in args.prefill_rows.split(",") if x],
                                      args.full, bw, total, seen)
        report += rows
        shapes[f"{n}x{k}"] = table
        torch.cuda.empty_cache()
        # Written after each projection, so a run cut short still leaves the projections it finished.
        tuning = tuning_dict(short, name, rows_list, shapes, total, seen, done, report, paths)
        out.write_text(json.dumps(tuning, indent=2) + "\n")
        print(f"wrote {out} ({done} of {len(SEED_GEMMS)} projections, {time.perf_counter() - t_start:.0f}s); "
              f"prefill path: {tuning['prefill']}", flush=True)
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps({"machine": name, "copy_bandwidth_tb_s": round(bw / 1e12, 3),
                                               "rows": report}, indent=2) + "\n")


def tuning_dict(short: str, name: str, rows_list: list[int], shapes: dict, total: dict, seen: dict, done: int,
                report: list[dict], paths: list[str]) -> dict:
    """The tuning file's content from the projections swept so far: per shape tables, the general
    decode table (per row count, the least total time among configs that ran on every projection so
    far) and the prefill path with the least total time."""
    decode = []
    for m in rows_list:
        everywhere = [(us, c) for (mm, c), us in total.items() if mm == m and seen[(mm, c)] == done]
        best = min(everywhere, key=lambda t: t[0])[1]
        decode.append({f: getattr(best, f) for f in FIELDS})
    prefill_rows = [r for r in report if "dequant_us" in r]
    prefill = min(paths, key=lambda p: sum(r.get(f"{p}_us", float("inf")) for r in prefill_rows))
    return {"device": short, "comment": f"bench/fp8_tune.py on one {name}, {time.strftime('%Y-%m-%d')}",
            "decode": decode, "shapes": shapes, "prefill": prefill, "prefill_min_m": max(rows_list),
            "prefill_config": {f: getattr(PREFILL_TILE, f) for f in FIELDS}}

if __name__ == "__main__":
    main()

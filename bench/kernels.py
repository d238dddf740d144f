"""Benchmark the Triton LoRA kernels on a CUDA GPU against the memory floor and torch baselines.

    python bench/kernels.py [--out bench/results/kernels-h200.json] [--quick] [--no-baselines] [--sweep FILE]

For the seed model shape (hidden 4096, kv 1024, mlp 14336; modules qkv, o, gate_up, down), bf16,
rank 16, tokens in {1, 16, 64, 256}, distinct adapters in {1, 8, 64, 128} (never more than tokens),
plus rank 8 in a rank-64 pool vs a rank-8 pool (B rank-major as the slot pool stores it, and a few
rows out-major), and k = 2 adapters per token. The meta's rank bound is the case's true rank, as
the engine sets it from the step's slots. Each row:

- lora_us: `add_lora(..., backend="triton")`: the split-K shrink + expand with `pick_config`,
  the expand launched with programmatic dependent launch where supported (`pdl`);
  no_pdl_us: the same without it.
- floor_us: bytes the op must move (each distinct adapter's A of every slice and B at its true rank,
  x read once, y read and written once) over the device-to-device copy bandwidth measured in this
  run (a 1 GiB copy).
- copy_us: a device-to-device copy that moves the same bytes (half read, half written; torch's
  copy kernel, one launch), timed as the op is: what moving that many bytes costs at all at this
  size, launch and ramp included.
- gather_us: torch gather-bmm (each token gathers its own A and B, padded to the pool rank).
- loop_us: per-adapter torch loop (one bf16 matmul pair per segment and slice, index_add into y).
- base_us: the base GEMM x @ W.T for the same module.
  (`--no-baselines` skips gather/loop/base: they take most of the run time.)

Timing: every op is captured in a CUDA graph (as the engine's decode step will be) that runs it over
`n_sets` copies of the weights and activations in turn, so successive calls do not hit in L2;
`triton.testing.do_bench` (which also clears L2 before each replay) gives the median replay time,
divided by `n_sets`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from lorafleet.kernels.lora_meta import LoraMeta, build_lora_meta
from lorafleet.kernels.lora_ops import add_lora, new_lora_b
from lorafleet.kernels.pdl import pdl_supported
from lorafleet.kernels.triton_lora import LoraKernelConfig, add_lora_triton, pick_config
from lorafleet.worker.cuda_graphs import chunk_class

HIDDEN, KV, MLP = 4096, 1024, 14336
MODULES: dict[str, tuple[int, list[int]]] = {
    "qkv": (HIDDEN, [HIDDEN, KV, KV]),
    "o": (HIDDEN, [HIDDEN]),
    "gate_up": (HIDDEN, [MLP, MLP]),
    "down": (MLP, [HIDDEN]),
}
DTYPE = torch.bfloat16
BYTES = 2
L2_FLUSH_BYTES = 256 * 2**20  # rotate through at least this much per graph replay
DEVICE = "cuda"


@dataclass(frozen=True, slots=True)
class Case:
    module: str
    tokens: int
    adapters: int
    rank: int
    pool_rank: int
    k: int = 1
    b_layout: str = "rank_major"  # as worker/lora/slots.py stores B; "out_major" = contiguous [S, out, r]


def main_cases(quick: bool) -> list[Case]:
    tokens_list = [1, 16, 64, 256]
    adapters_list = [1, 8, 64, 128]
    cases = []
    for module in MODULES:
        for tokens in tokens_list:
            for adapters in adapters_list:
                if adapters <= tokens:
                    cases.append(Case(module, tokens, adapters, 16, 16))
        for tokens, adapters in [(64, 8), (64, 64), (256, 64)]:
            cases.append(Case(module, tokens, adapters, 8, 8))
            cases.append(Case(module, tokens, adapters, 8, 64))
            if tokens == 64:
                cases.append(Case(module, tokens, adapters, 8, 64, b_layout="out_major"))
            cases.append(Case(module, tokens, adapters, 16, 16, k=2))
    if quick:
        cases = [c for c in cases if c.tokens in (16, 64) and c.module in ("qkv", "down")]
    return cases


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    n = 2**30 // 4
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3)


def time_graph(calls: list[Callable[[], None]]) -> float:
    """Median µs per call of `calls`, captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:  # warm up: compile kernels, allocate workspaces
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = do_bench(graph.replay, warmup=25, rep=150, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def copy_us(nbytes: float) -> float:
    """µs of one device-to-device copy moving `nbytes` (half read, half written), timed as the
    kernels are: in a CUDA graph over up to 32 buffer pairs (≥ 256 MiB where that cap allows, as
    the kernels' `n_sets`), so successive copies miss L2 except for the smallest sizes."""
    n = max(1, int(nbytes // 8))  # float32 elements each side
    pairs = [(torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE))
             for _ in range(max(2, min(32, math.ceil(L2_FLUSH_BYTES / (8 * n)))))]
    return time_graph([lambda d=d, src=src: d.copy_(src) for d, src in pairs])


@dataclass(slots=True)
class Inputs:
    x: torch.Tensor  # [T, in]
    y: torch.Tensor  # [T, Σout]
    lora_a: list[torch.Tensor]  # [S, pool_rank, in] per slice
    lora_b: list[torch.Tensor]  # [S, out_s, pool_rank] per slice


def make_case_inputs(
    case: Case, g: torch.Generator
) -> tuple[list[Inputs], torch.Tensor, torch.Tensor, list[list[int]]]:
    d_in, outs = MODULES[case.module]
    slots = case.adapters
    active_bytes = adapter_bytes(case)
    act_bytes = case.tokens * (d_in + sum(outs)) * BYTES
    n_sets = max(2, min(32, math.ceil(L2_FLUSH_BYTES / (active_bytes + act_bytes))))
    sets = []
    for _ in range(n_sets):
        lora_a = [
            torch.randn(slots, case.pool_rank, d_in, device=DEVICE, dtype=DTYPE) / d_in**0.5 for _ in outs
        ]
        lora_b = [
            torch.randn(slots, o, case.pool_rank, device=DEVICE, dtype=DTYPE) / case.rank**0.5 for o in outs
        ]
        if case.b_layout == "rank_major":
            lora_b = [store_rank_major(b) for b in lora_b]
        x = torch.randn(case.tokens, d_in, device=DEVICE, dtype=DTYPE)
        y = torch.randn(case.tokens, sum(outs), device=DEVICE, dtype=DTYPE)
        sets.append(Inputs(x, y, lora_a, lora_b))
    token_slots = case_token_slots(case)
    token_scales = torch.rand(case.tokens, case.k, generator=g) + 0.5
    ranks = [[case.rank] * slots for _ in outs]
    return sets, token_slots, token_scales, ranks


def case_token_slots(case: Case) -> torch.Tensor:
    """`[T, k]` int32: each of the `adapters` slots gets tokens / adapters tokens; with k = 2 a
    token's second adapter is the next slot, so every adapter appears in both entry columns."""
    t = torch.arange(case.tokens)
    first = (t * case.adapters) // case.tokens
    return torch.stack([(first + j) % case.adapters for j in range(case.k)], 1).to(torch.int32)


def case_meta(case: Case, token_slots: torch.Tensor, token_scales: torch.Tensor) -> LoraMeta:
    """The case's step metadata as the engine launches it."""
    meta = build_lora_meta(token_slots, token_scales, case.adapters, DEVICE)
    meta.rank_bound = case.rank  # as ModelRunner sets it: the step's largest true rank
    meta.launch_chunks = chunk_class(meta.num_chunks, meta.max_chunks)  # as a decode graph launches
    return meta


def parse_cases(text: str, rank: int = 16) -> list[Case]:
    """"MODULE:TOKENS:ADAPTERS,..." -> rank-`rank` cases in a pool of that rank."""
    cases = []
    for spec in text.split(","):
        module, tokens, adapters = spec.split(":")
        cases.append(Case(module, int(tokens), int(adapters), rank, rank))
    return cases


def adapter_bytes(case: Case) -> int:
    """Each distinct adapter's A (one per slice) and B, at its true rank."""
    d_in, outs = MODULES[case.module]
    return case.adapters * case.rank * (len(outs) * d_in + sum(outs)) * BYTES


def store_rank_major(b: torch.Tensor) -> torch.Tensor:
    """The same values in the slot pool's layout (`new_lora_b`: rank-major memory)."""
    stored = new_lora_b(b.shape[0], b.shape[1], b.shape[2], device=b.device, dtype=b.dtype)
    stored.copy_(b)
    return stored


def gather_bmm(inp: Inputs, slots_dev: torch.Tensor, scales_dev: torch.Tensor) -> None:
    """Each token gathers its adapter's (pool-padded) A and B, then two batched matvecs."""
    col = 0
    safe = slots_dev.clamp_min(0).long()  # [T, k]
    weight = torch.where(slots_dev >= 0, scales_dev, 0).to(DTYPE)  # [T, k]
    for a, b in zip(inp.lora_a, inp.lora_b, strict=True):
        out = b.shape[1]
        for j in range(safe.shape[1]):
            h = torch.bmm(a[safe[:, j]], inp.x.unsqueeze(2))  # [T, r, 1]
            h = h * weight[:, j, None, None]
            inp.y[:, col : col + out] += torch.bmm(b[safe[:, j]], h).squeeze(2)  # [T, out]
        col += out


def segment_loop(inp: Inputs, meta: LoraMeta, ranks: list[list[int]]) -> None:
    """One bf16 matmul pair per (adapter segment, slice), added with index_add_."""
    for slot, start, end in meta.segments:
        rows = meta.sorted_token[start:end].long()
        scale = meta.sorted_scale[start:end].to(DTYPE).unsqueeze(1)
        xs = inp.x.index_select(0, rows)
        col = 0
        for a, b, slice_ranks in zip(inp.lora_a, inp.lora_b, ranks, strict=True):
            out, r = b.shape[1], slice_ranks[slot]
            inp.y[:, col : col + out].index_add_(0, rows, ((xs @ a[slot, :r].T) * scale) @ b[slot, :, :r].T)
            col += out


def check_and_time(
    sets: list[Inputs],
    ranks: list[list[int]],
    ranks_dev: torch.Tensor,
    meta: LoraMeta,
    config: LoraKernelConfig | None,
    pdl: bool | None = None,
) -> tuple[float, float]:
    """(µs per call, ‖Δtriton − Δref‖ / ‖Δref‖ on the first set) of `add_lora_triton`.

    Every set's y is restored afterwards (timing adds the delta into it thousands of times), so
    the next call's error is measured on the original values.
    """
    inp = sets[0]
    saved = [s.y.clone() for s in sets]
    y0 = inp.y.clone()
    ref = inp.y.clone()
    add_lora(ref, inp.x, inp.lora_a, inp.lora_b, ranks, ranks_dev, meta, backend="torch")
    add_lora_triton(inp.y, inp.x, inp.lora_a, inp.lora_b, ranks_dev, meta, config=config, pdl=pdl)
    d_ref, d_tri = (ref.double() - y0.double()), (inp.y.double() - y0.double())
    rel_err = float((d_tri - d_ref).norm() / d_ref.norm())
    inp.y.copy_(y0)
    us = time_graph(
        [
            lambda s=s: add_lora_triton(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta, config=config, pdl=pdl)
            for s in sets
        ]
    )
    for s, y in zip(sets, saved, strict=True):
        s.y.copy_(y)
    return us, rel_err


def run_case(
    case: Case,
    bandwidth: float,
    g: torch.Generator,
    config: LoraKernelConfig | None = None,
    baselines: bool = True,
) -> dict:
    d_in, outs = MODULES[case.module]
    sets, token_slots, token_scales, ranks = make_case_inputs(case, g)
    meta = case_meta(case, token_slots, token_scales)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    row = dict(asdict(case))
    act_bytes = case.tokens * (d_in + 2 * sum(outs)) * BYTES
    row.update(floor_us=round((adapter_bytes(case) + act_bytes) / bandwidth * 1e6, 2), n_sets=len(sets))
    if config is None:  # the table's rows (a sweep compares configs only)
        row["copy_us"] = round(copy_us(adapter_bytes(case) + act_bytes), 2)
    us, err = check_and_time(sets, ranks, ranks_dev, meta, config)
    row.update(lora_us=round(us, 2), rel_err=float(f"{err:.2e}"), pdl=pdl_supported(torch.cuda.current_device()))
    if config is not None:
        return row
    if row["pdl"]:
        us, err = check_and_time(sets, ranks, ranks_dev, meta, config, pdl=False)
        row.update(no_pdl_us=round(us, 2), rel_err=max(row["rel_err"], float(f"{err:.2e}")))
    if not baselines:
        row.update(gather_us=None, loop_us=None, base_us=None)
        return row
    slots_dev, scales_dev = meta.token_slots, meta.token_scales
    row["gather_us"] = round(time_graph([lambda s=s: gather_bmm(s, slots_dev, scales_dev) for s in sets]), 2)
    row["loop_us"] = round(time_graph([lambda s=s: segment_loop(s, meta, ranks) for s in sets]), 2)
    row["base_us"] = base_gemm_us(case.module, case.tokens)
    return row


_BASE_CACHE: dict[tuple[str, int], float] = {}


def base_gemm_us(module: str, tokens: int) -> float:
    key = (module, tokens)
    if key not in _BASE_CACHE:
        d_in, outs = MODULES[module]
        n_w = max(2, math.ceil(L2_FLUSH_BYTES / (d_in * sum(outs) * BYTES)))
        ws = [torch.randn(sum(outs), d_in, device=DEVICE, dtype=DTYPE) for _ in range(n_w)]
        xs = [torch.randn(tokens, d_in, device=DEVICE, dtype=DTYPE) for _ in range(n_w)]
        _BASE_CACHE[key] = round(
            time_graph([lambda w=w, x=x: torch.mm(x, w.T) for w, x in zip(ws, xs, strict=True)]), 2
        )
    return _BASE_CACHE[key]


SWEEP_CASES = [(16, 1), (64, 8), (64, 64), (256, 128)]


def sweep(bandwidth: float, g: torch.Generator, cases: list[tuple[int, int]] = SWEEP_CASES) -> list[dict]:
    """Time launch configs on representative (tokens, adapters) cases, to tune `pick_config`."""
    rows = []
    for module, (d_in, outs) in MODULES.items():
        n_slices = len(outs)
        for tokens, adapters in cases:
            case = Case(module, tokens, adapters, 16, 16)
            slots = case_token_slots(case)
            meta = case_meta(case, slots, torch.ones(slots.shape))
            default = pick_config(meta.num_chunks, n_slices, d_in, meta.chunk_size, meta.one_pair_chunks)
            configs = {default}
            for n_per_prog in (128, 256, 512, 1024, 2048, 4096):
                for block_n in (64, 128, 256):
                    if block_n <= n_per_prog:
                        configs.add(replace(default, n_per_prog=n_per_prog, block_n=block_n, expand_rows=False))
            for split_k in (1, max(1, default.split_k // 2), default.split_k * 2):
                configs.add(replace(default, split_k=split_k))
            for block_k in (64, 128, 256):
                configs.add(replace(default, block_k=block_k))
            configs.add(replace(default, expand_warps=8))
            configs.add(replace(default, shrink_warps=2))
            case_rows = []
            for cfg in sorted(configs, key=lambda c: (c.split_k, c.n_per_prog, c.block_n, c.expand_warps)):
                row = run_case(case, bandwidth, g, config=cfg, baselines=False)
                row.update(asdict(cfg), default=cfg == default)
                case_rows.append(row)
            best = min(case_rows, key=lambda r: r["lora_us"])
            default_us = next(r["lora_us"] for r in case_rows if r["default"])
            knobs = {k: best[k] for k in ("split_k", "n_per_prog", "block_n", "block_k", "shrink_warps", "expand_warps")}
            print(
                f"sweep {module:8s} T={tokens:4d} A={adapters:4d}: default {default_us} µs, "
                f"best {best['lora_us']} µs {knobs}, floor {best['floor_us']} µs",
                flush=True,
            )
            rows += case_rows
    return rows


def _us(v: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}s}" if v is None else f"{v:{width}.{digits}f}"


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'module':8s} {'T':>4s} {'A':>4s} {'r':>3s} {'pool':>4s} {'B':>5s} {'k':>2s} {'lora':>8s} {'no-pdl':>8s} "
        f"{'floor':>7s} {'target':>7s} {'copy':>7s} {'gather':>8s} {'loop':>9s} {'base':>8s} "
        f"{'err':>8s}"
    )
    print(head)
    for r in rows:
        target = 1.3 * r["floor_us"] + 3
        mark = "" if r["tokens"] < 16 else (" ok" if r["lora_us"] <= target else " MISS")
        print(
            f"{r['module']:8s} {r['tokens']:4d} {r['adapters']:4d} {r['rank']:3d} {r['pool_rank']:4d} "
            f"{r['b_layout'][:5]:>5s} {r['k']:2d} {r['lora_us']:8.2f} {_us(r.get('no_pdl_us'), 8)} {r['floor_us']:7.2f} {target:7.2f} {_us(r.get('copy_us'), 7)} {_us(r['gather_us'], 8)} "
            f"{_us(r['loop_us'], 9)} {_us(r['base_us'], 8)} {r['rel_err']:8.1e}{mark}"
        )


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table, with the tokens >= 16 target checked."""
    lines = [
        "| module | T | adapters | rank | pool | B | k | lora µs | floor µs | 1.3·floor+3 | copy µs | gather µs "
        "| loop µs | base µs |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(v: float | None) -> str:
        return "–" if v is None else f"{v:.1f}"

    for r in rows:
        target = 1.3 * r["floor_us"] + 3
        mark = "" if r["tokens"] < 16 else (" ✓" if r["lora_us"] <= target else " ✗")
        lines.append(
            f"| {r['module']} | {r['tokens']} | {r['adapters']} | {r['rank']} | {r['pool_rank']} | "
            f"{r.get('b_layout', 'out_major')} | {r['k']} | {r['lora_us']:.1f}{mark} | "
            f"{r['floor_us']:.1f} | {target:.1f} | {cell(r.get('copy_us'))} | "
            f"{cell(r['gather_us'])} | {cell(r['loop_us'])} | {cell(r['base_us'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/kernels-h200.json")
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument(
        "--no-baselines", action="store_true", help="skip the torch gather/loop and base GEMM timings"
    )
    parser.add_argument("--sweep", default=None, help="also time launch configs; write them to this file")
    parser.add_argument("--sweep-cases", default=None, help="TOKENS:ADAPTERS,... for --sweep (default: a few)")
    parser.add_argument("--sweep-only", action="store_true", help="skip the main table")
    parser.add_argument("--markdown", default=None, help="print a results file as a markdown table and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for case in [] if args.sweep_only else main_cases(args.quick):
        rows.append(run_case(case, bandwidth, g, baselines=not args.no_baselines))
        r = rows[-1]
        print(
            f"  {case}: {r['lora_us']} µs floor {r['floor_us']} µs err {r['rel_err']}",
            flush=True,
        )
        torch.cuda.empty_cache()
    print(
        f"machine {torch.cuda.get_device_name()}, date {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, python {platform.python_version()}, copy bandwidth {bandwidth / 1e12:.3f} TB/s"
    )
    if rows:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print_table(rows)
    if args.sweep:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.sweep_cases.split(",")] if args.sweep_cases else SWEEP_CASES
        Path(args.sweep).write_text(json.dumps(sweep(bandwidth, g, cases), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An experiment for the next GPU session: the LoRA shrink as a multiply-and-sum, no `tl.dot`.

    python -m bench.shrink_gemv [--cases qkv:64:64,...] [--store] [--out FILE]

Why: at 64 adapters in a 64-token decode step every chunk holds one token, yet the production
shrink (`lora_kernels._lora_shrink_kernel`) multiplies a 16-row `tl.dot` tile staged through shared
memory. On the H200 it reaches ~50% of DRAM bandwidth at 12-17% occupancy (ncu,
`bench/results/ncu-lora-h200.csv`), and neither wider K tiles nor more stages or K splits helped
(docs/benchmarks.md, engine section, "Seventh session"). This kernel does each chunk row as a
matrix-vector product in registers: per program one (chunk, K split, slice, rank block) as in the
production grid, for each row of the chunk `acc[r] += Σ_k A[slot, r, k] · x[token, k]` over
BLOCK_K-wide tiles, no shared memory, partials in the production layout so the production expand
reads them. Rows of a chunk re-read their A tile (from L1/L2), so chunks of many rows favour the
`tl.dot` kernel; the harness times both.

Per case (built as bench/kernels.py builds it; 64 tokens, rank 16): the production shrink (the
default config), this one for BLOCK_K x warps, each checked against the production partials
(relative error of the partials, `rel_err`), then the pair (shrink + the production expand, PDL
where supported) for the default and the fastest variant. Timing as in bench/kernels.py. Not used
by the engine; `tests/bench/test_shrink_gemv.py` checks it against the production shrink in the
interpreter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from lorafleet.kernels.triton_lora import (
    LoraLaunch,
    launch_expand,
    launch_shrink,
    pick_config,
    plan_lora_triton,
)

try:
    from bench import kernels as kb
except ImportError:  # python bench/shrink_gemv.py
    import kernels as kb

DEFAULT_CASES = "qkv:64:64,o:64:64,gate_up:64:64,down:64:64,qkv:64:8,gate_up:64:8"
VARIANTS = [(block_k, warps) for block_k in (256, 512, 1024) for warps in (2, 4, 8)]


@triton.jit
def _shrink_gemv_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    ranks_ptr,
    chunk_slot_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    sorted_token_ptr,
    part_ptr,
    K,
    K_PER_SPLIT,
    stride_xt,
    stride_as,
    stride_ar,
    stride_rs,
    stride_ps,
    stride_pm,
    R_MAX: tl.constexpr,
    R_PAD: tl.constexpr,
    R_BLOCKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
    PDL: tl.constexpr,
):
    """part[split, pair, s*R_PAD + r] = Σ_{k in split} x[token(pair), k] · A_s[slot, r, k], one row at a time."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_c = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_sr = tl.program_id(2)
    slot = tl.load(chunk_slot_ptr + pid_c)
    start = tl.load(chunk_start_ptr + pid_c)
    end = tl.load(chunk_end_ptr + pid_c)
    if slot < 0:
        return
    s = pid_sr // R_BLOCKS
    r0 = (pid_sr % R_BLOCKS) * BLOCK_RANK
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), tl.minimum(R_MAX, R_PAD))
    if r0 >= rank:
        return
    if s == 0:
        a_ptr = a0_ptr
    elif s == 1:
        a_ptr = a1_ptr
    else:
        a_ptr = a2_ptr
    offs_r = r0 + tl.arange(0, BLOCK_RANK)
    r_mask = offs_r < rank
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar  # [BLOCK_RANK, 1]
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for m in range(start, end):  # the chunk's rows: one each at 64 adapters in a 64-token step
        tok = tl.load(sorted_token_ptr + m).to(tl.int64)
        acc = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            xv = tl.load(x_ptr + tok * stride_xt + offs_k, mask=k_mask, other=0.0)
            acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        # Written even when this split's K range is empty, as the production shrink does.
        tl.store(part_ptr + pid_k * stride_ps + m * stride_pm + s * R_PAD + offs_r, acc, mask=r_mask)


def launch_shrink_gemv(plan: LoraLaunch, block_k: int, warps: int) -> None:
    """The same partials as `triton_lora.launch_shrink(plan)`, into `plan.part`, on the current stream."""
    x, meta, cfg, a = plan.x, plan.meta, plan.cfg, plan.lora_a
    in_features = x.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(in_features, cfg.split_k), block_k) * block_k
    grid = (meta.grid_chunks, cfg.split_k, plan.n_slices * plan.r_blocks)
    _shrink_gemv_kernel[grid](
        x, *(a + [a[0]] * (3 - plan.n_slices)), plan.ranks_device, meta.chunk_slot, meta.chunk_start,
        meta.chunk_end, meta.sorted_token, plan.part, in_features, k_per_split, x.stride(0), a[0].stride(0),
        a[0].stride(1), plan.ranks_device.stride(0), plan.part.stride(0), plan.part.stride(1),
        R_MAX=plan.r_max, R_PAD=plan.r_pad, R_BLOCKS=plan.r_blocks, BLOCK_K=block_k, BLOCK_RANK=16,
        PDL=plan.pdl, num_warps=warps,
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def run_case(case: kb.Case, g: torch.Generator, store: bool) -> list[dict]:
    d_in, outs = kb.MODULES[case.module]
    sets, token_slots, token_scales, ranks = kb.make_case_inputs(case, g)
    meta = kb.case_meta(case, token_slots, token_scales)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    cfg = pick_config(meta.num_chunks, len(outs), d_in, meta.chunk_size)

    def plans(pdl: bool | None) -> list[LoraLaunch]:
        return [plan_lora_triton(s.x, s.lora_a, s.lora_b, ranks_dev, meta, cfg, pdl) for s in sets]

    head = {"module": case.module, "tokens": case.tokens, "adapters": case.adapters, "rank": case.rank,
            "config": str(cfg)}
    ps = plans(False)
    ps[0].part.zero_()
    launch_shrink(ps[0])
    ref = ps[0].part.sum(0)  # the splits' sum, which the expand reads: each kernel cuts K its own way
    rows = [{**head, "kernel": "production", "part": "shrink",
             "us": round(kb.time_graph([lambda p=p: launch_shrink(p) for p in ps]), 2)}]
    for block_k, warps in VARIANTS:
        ps[0].part.zero_()
        launch_shrink_gemv(ps[0], block_k, warps)
        err = rel_err(ps[0].part.sum(0), ref)
        us = kb.time_graph([lambda p=p, bk=block_k, w=warps: launch_shrink_gemv(p, bk, w) for p in ps])
        rows.append({**head, "kernel": "gemv", "part": "shrink", "block_k": block_k, "warps": warps,
                     "us": round(us, 2), "rel_err": float(f"{err:.2e}")})
    best = min((r for r in rows if r["kernel"] == "gemv"), key=lambda r: r["us"])
    pp = plans(None)
    bk, w = best["block_k"], best["warps"]
    pairs = {
        "production": [lambda p=p, s=s: (launch_shrink(p), launch_expand(p, s.y, store))
                       for p, s in zip(pp, sets, strict=True)],
        "gemv": [lambda p=p, s=s: (launch_shrink_gemv(p, bk, w), launch_expand(p, s.y, store))
                 for p, s in zip(pp, sets, strict=True)],
    }
    for kernel, calls in pairs.items():
        rows.append({**head, "kernel": kernel, "part": "pair", "us": round(kb.time_graph(calls), 2),
                     **({"block_k": best["block_k"], "warps": best["warps"]} if kernel == "gemv" else {})})
    for r in rows:
        knobs = f" K tile {r['block_k']}, {r['warps']} warps" if "block_k" in r else ""
        err = f", rel_err {r['rel_err']}" if "rel_err" in r else ""
        print(f"{case.module:8s} T={case.tokens} A={case.adapters} {r['part']:6s} {r['kernel']:10s}{knobs}: "
              f"{r['us']:7.2f} µs{err}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="MODULE:TOKENS:ADAPTERS,...")
    ap.add_argument("--store", action="store_true", help="the storing expand in the pair (the engine's side path)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/shrink-gemv-h200.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = kb.measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for case in kb.parse_cases(args.cases):
        rows += run_case(case, g, args.store)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bandwidth_tb_s": round(bandwidth / 1e12, 3), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

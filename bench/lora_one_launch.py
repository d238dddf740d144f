"""Experiment: the LoRA shrink and expand in one launch, a grid-wide barrier between them.

    python -m bench.lora_one_launch [--cases qkv:64:64,...] [--per-sm 1,2,4] [--out FILE]

The kernel table's gap to its floor target is what two dependent launches cost over one that only
moves the bytes (docs/benchmarks.md, "Against the targets (issue 3)": a device copy of each row's
bytes meets the target everywhere). This times a persistent kernel that does both phases itself:
its programs (a few per SM, all resident at once) walk the shrink's (chunk, split, slice) items,
meet at a barrier in global memory, then walk the expand's (chunk, column group) items, adding
into y. Against `add_lora_triton` (two launches, the expand with programmatic dependent launch) and
a device copy of the same bytes, on the kernel table's inputs and timing (bench/kernels.py).

Decode-shaped steps only (k = 1, rank-16 adapters in a rank-16 pool, B rank-major as the slot pool
stores it), and GPU only: under the interpreter the programs run one after another and the barrier
would never open, so `one_launch(..., phases=(1, 2))` runs the two halves as two launches there
(the tests check the math that way). Not used by the engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from lorafleet.kernels import interpreting
from lorafleet.kernels.lora_ops import lora_b_layout

R = tl.constexpr(16)  # rank tile: the adapters' (true and pool) rank here


@triton.jit
def _one_launch_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, ranks_ptr,
    chunk_slot_ptr, chunk_start_ptr, chunk_end_ptr, sorted_token_ptr, sorted_scale_ptr, part_ptr, sync_ptr,
    K, K_PER_SPLIT, N_CHUNKS, SPLIT_K, N_SLICES, OUT0, OUT1, OUT2, GROUPS0, GROUPS1, GROUPS,
    stride_xt, stride_as, stride_ar, stride_yt, stride_rs, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, N_PER_PROG: tl.constexpr,
    PHASE: tl.constexpr,  # 0: both, with the barrier; 1: the shrink only; 2: the expand only
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter's bf16 dot is wrong)
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_r = tl.arange(0, R)
    if PHASE != 2:
        for item in range(pid, N_CHUNKS * SPLIT_K * N_SLICES, n_prog):
            c = item // (SPLIT_K * N_SLICES)
            sp = (item // N_SLICES) % SPLIT_K
            s = item % N_SLICES
            slot = tl.load(chunk_slot_ptr + c)
            start = tl.load(chunk_start_ptr + c)
            end = tl.load(chunk_end_ptr + c)
            if slot >= 0:
                rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R)
                offs_m = start + tl.arange(0, BLOCK_M)
                m_mask = offs_m < end
                tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                if s == 0:
                    a_ptr = a0_ptr
                elif s == 1:
                    a_ptr = a1_ptr
                else:
                    a_ptr = a2_ptr
                r_mask = offs_r < rank
                k_lo = sp * K_PER_SPLIT
                k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
                x_rows = x_ptr + tok[:, None] * stride_xt
                a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
                acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    k_mask = offs_k < k_hi
                    xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                    at = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                    if UPCAST:
                        xt = xt.to(tl.float32)
                        at = at.to(tl.float32)
                    acc += tl.dot(xt, at)
                p = part_ptr + sp * stride_ps + offs_m[:, None].to(tl.int64) * stride_pm + s * R + offs_r[None, :]
                tl.store(p, acc, mask=m_mask[:, None] & r_mask[None, :])
    if PHASE == 0:
        # Grid barrier (every program is resident: the grid is a few programs per SM). The
        # generation is read before arriving, so it can only change once all have arrived.
        tl.debug_barrier()  # this program's partial stores precede its arrival
        gen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
        if arrived == n_prog - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_add(sync_ptr + 1, 1, sem="release")
        else:
            while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == gen:
                pass
        tl.debug_barrier()
    if PHASE != 1:
        for item in range(pid, N_CHUNKS * GROUPS, n_prog):
            c = item // GROUPS
            g = item % GROUPS
            slot = tl.load(chunk_slot_ptr + c)
            start = tl.load(chunk_start_ptr + c)
            end = tl.load(chunk_end_ptr + c)
            if slot >= 0:
                if g < GROUPS0:
                    s = 0
                    n_lo = g * N_PER_PROG
                    out = OUT0
                    col0 = 0
                    b_ptr = b0_ptr
                elif g < GROUPS0 + GROUPS1:
                    s = 1
                    n_lo = (g - GROUPS0) * N_PER_PROG
                    out = OUT1
                    col0 = OUT0
                    b_ptr = b1_ptr
                else:
                    s = 2
                    n_lo = (g - GROUPS0 - GROUPS1) * N_PER_PROG
                    out = OUT2
                    col0 = OUT0 + OUT1
                    b_ptr = b2_ptr
                rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), R)
                if rank > 0:
                    offs_m = start + tl.arange(0, BLOCK_M)
                    m_mask = offs_m < end
                    tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                    scale = tl.load(sorted_scale_ptr + offs_m, mask=m_mask, other=0.0)
                    r_mask = offs_r < rank
                    p = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + s * R + offs_r[None, :]
                    h = tl.zeros((BLOCK_M, R), dtype=tl.float32)
                    for sp in range(0, SPLIT_K):  # written by other SMs: read from L2, not L1
                        h += tl.load(p + sp * stride_ps, mask=m_mask[:, None] & r_mask[None, :], other=0.0,
                                     cache_modifier=".cg")
                    h = tl.where(r_mask[None, :], h * scale[:, None], 0.0)
                    if not UPCAST:
                        h = h.to(b0_ptr.dtype.element_ty)
                    n_hi = tl.minimum(n_lo + N_PER_PROG, out)
                    # rank-major B (the slot pool's layout): [S, R, out] memory, per slice's out
                    b_base = b_ptr + slot.to(tl.int64) * out * R + offs_r[:, None] * out
                    y_rows = y_ptr + tok[:, None] * stride_yt + col0
                    for n0 in range(n_lo, n_hi, BLOCK_N):
                        offs_n = n0 + tl.arange(0, BLOCK_N)
                        n_mask = offs_n < n_hi
                        bt = tl.load(b_base + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
                        if UPCAST:
                            bt = bt.to(tl.float32)
                        acc = tl.dot(h, bt)
                        mask = m_mask[:, None] & n_mask[None, :]
                        cur = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
                        tl.store(y_rows + offs_n[None, :], (cur.to(tl.float32) + acc).to(y_ptr.dtype.element_ty),
                                 mask=mask)


def one_launch(y, x, lora_a, lora_b, ranks_dev, meta, part, sync, programs: int, split_k: int,
               block_k: int = 128, block_n: int = 128, n_per_prog: int = 256, phases=(0,)) -> None:
    """y[:, slices] += Σ scale · B(A x) in one launch (phases=(0,)), or as two (phases=(1, 2))."""
    n_slices = len(lora_a)
    if any(lora_b_layout(t) != "rank_major" or t.shape[2] != R for t in lora_b):
        raise ValueError("rank-major B of pool rank 16 only (the slot pool's layout)")
    if any(t.shape[1] != R or not t.is_contiguous() for t in lora_a):
        raise ValueError("contiguous A of pool rank 16 only")
    K = x.shape[1]
    outs = [b.shape[1] for b in lora_b] + [0] * (3 - n_slices)
    groups = [triton.cdiv(o, n_per_prog) for o in outs]
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    a = list(lora_a) + [lora_a[0]] * (3 - n_slices)
    b = list(lora_b) + [lora_b[0]] * (3 - n_slices)
    for phase in phases:
        _one_launch_kernel[(programs,)](
            x, *a, *b, y, ranks_dev, meta.chunk_slot, meta.chunk_start, meta.chunk_end, meta.sorted_token,
            meta.sorted_scale, part, sync,
            K, k_per_split, meta.grid_chunks, split_k, n_slices, outs[0], outs[1], outs[2], groups[0], groups[1],
            sum(groups), x.stride(0), a[0].stride(0), a[0].stride(1), y.stride(0), ranks_dev.stride(0), part.stride(0), part.stride(1),
            BLOCK_M=meta.chunk_size, BLOCK_K=block_k, BLOCK_N=block_n, N_PER_PROG=n_per_prog, PHASE=phase,
            UPCAST=interpreting() or x.dtype == torch.float32,
            num_warps=4,
        )


def time_case(case, bandwidth: float, sms: int, per_sm: list[int], g: torch.Generator) -> dict:
    from bench import kernels as kb
    from lorafleet.kernels.lora_ops import add_lora
    from lorafleet.kernels.triton_lora import add_lora_triton, pick_config

    d_in, outs = kb.MODULES[case.module]
    sets, token_slots, token_scales, ranks = kb.make_case_inputs(case, g)
    meta = kb.case_meta(case, token_slots, token_scales)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    cfg = pick_config(meta.num_chunks, len(outs), d_in, meta.chunk_size)
    part = torch.empty((cfg.split_k, case.tokens, len(outs) * R), device="cuda", dtype=torch.float32)
    sync = torch.zeros(2, device="cuda", dtype=torch.int32)
    floor = (kb.adapter_bytes(case) + case.tokens * (d_in + 2 * sum(outs)) * kb.BYTES) / bandwidth * 1e6
    row = {"module": case.module, "tokens": case.tokens, "adapters": case.adapters, "split_k": cfg.split_k,
           "floor_us": round(floor, 2), "target_us": round(1.3 * floor + 3, 2),
           "copy_us": round(kb.copy_us(floor * 1e-6 * bandwidth), 2)}
    # Errors first, on y as made: the timed replays add their delta into y thousands of times, and
    # a delta added to the grown bf16 values would round away.
    inp = sets[0]
    y0 = inp.y.clone()
    ref = y0.clone()
    add_lora(ref, inp.x, inp.lora_a, inp.lora_b, ranks, ranks_dev, meta, backend="torch")
    d_ref = ref.double() - y0.double()
    errs = {}
    for n in per_sm:
        one_launch(inp.y, inp.x, inp.lora_a, inp.lora_b, ranks_dev, meta, part, sync, sms * n, cfg.split_k)
        errs[n] = float(((inp.y.double() - y0.double()) - d_ref).norm() / d_ref.norm())
        inp.y.copy_(y0)
    row["two_launches_us"] = round(kb.time_graph(
        [lambda s=s: add_lora_triton(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta) for s in sets]), 2)
    for n in per_sm:
        programs = sms * n
        err = errs[n]
        us = kb.time_graph([lambda s=s, p=programs: one_launch(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta, part,
                                                               sync, p, cfg.split_k) for s in sets])
        row[f"one_launch_{n}_us"] = round(us, 2)
        row[f"one_launch_{n}_err"] = float(f"{err:.2e}")
    return row


def main() -> None:
    from bench import kernels as kb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="qkv:64:64,o:64:64,gate_up:64:64,down:64:64,qkv:64:8,down:64:8,"
                                       "qkv:16:1,down:16:1,qkv:256:128,down:256:128")
    ap.add_argument("--per-sm", default="1,2,4", help="programs per SM for the persistent grid")
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora-one-launch-h200.json"))
    args = ap.parse_args()
    bandwidth = kb.measure_copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(0)
    rows = []
    for case in kb.parse_cases(args.cases):
        rows.append(time_case(case, bandwidth, sms, [int(v) for v in args.per_sm.split(",")], g))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bandwidth_tb_s": round(bandwidth / 1e12, 3), "sms": sms, "rows": rows},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()

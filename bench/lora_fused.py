"""Experiment: the LoRA shrink and expand in one launch, each chunk's expand waiting on a flag.

    python -m bench.lora_fused [--cases qkv:64:64,...] [--out FILE]

The kernel table's gap to its floor target is what two dependent launches cost (a device copy of
each row's bytes meets the target). A persistent kernel with a grid barrier was slower everywhere
(twelfth session). This one keeps the two launches' grids, concatenated into one launch: the
shrink's (chunk, split, rank block) programs first, then the expand's (chunk, column group)
programs. A shrink program stores its partials and adds 1 to its chunk's flag (release); an expand
program loads its first B tile and y rows, then polls its chunk's flag (acquire) until every shrink
program of the chunk has added, sums the partials (from L2) and writes y. The last expand program of
a chunk resets the chunk's counters, so the next launch finds them zero.

A program only ever waits for programs that come before it in the order programs start. TICKET:
each program takes its item from a counter (an atomic on start), so that holds by construction;
without it the item is the program id, which relies on the GPU starting a grid's programs in id
order. Decode-shaped steps (k = 1) in the kernel table's timing (bench/kernels.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from lorafleet.kernels.lora_kernels import _dot, _load_b_tile, _write_tile
from lorafleet.kernels.lora_ops import _check_shapes
from lorafleet.kernels.triton_lora import LoraLaunch

SYNC_FLAGS = tl.constexpr(64)  # int32 offset of the chunks' flags (the ticket counters sit in the first 128 bytes)


@triton.jit
def _lora_fused_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, ranks_ptr,
    chunk_slot_ptr, chunk_start_ptr, chunk_end_ptr, sorted_token_ptr, sorted_scale_ptr, part_ptr, sync_ptr,
    K, K_PER_SPLIT, N_SHRINK, N_CHUNKS, OUT0, OUT1, OUT2, GROUPS0, GROUPS1, GROUPS, SPLIT_K,
    stride_xt, stride_as, stride_ar, stride_yt, stride_rs, stride_ps, stride_pm,
    N_SR: tl.constexpr, R_MAX: tl.constexpr, R_PAD: tl.constexpr, R_BLOCKS: tl.constexpr, R_BLOCK: tl.constexpr,
    B_RANK_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr, N_PER_PROG: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ROWS: tl.constexpr, ATOMIC: tl.constexpr, STORE: tl.constexpr, Y_EARLY: tl.constexpr, TICKET: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if TICKET:
        item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    else:
        item = tl.program_id(0)
    flags = sync_ptr + SYNC_FLAGS
    dones = flags + N_CHUNKS
    if item < N_SHRINK:
        c = item // (SPLIT_K * N_SR)
        pid_k = (item // N_SR) % SPLIT_K
        pid_sr = item % N_SR
        slot = tl.load(chunk_slot_ptr + c)
        start = tl.load(chunk_start_ptr + c)
        end = tl.load(chunk_end_ptr + c)
        if slot >= 0:
            s = pid_sr // R_BLOCKS
            r0 = (pid_sr % R_BLOCKS) * BLOCK_RANK
            rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), tl.minimum(R_MAX, R_PAD))
            offs_m = start + tl.arange(0, BLOCK_M)
            m_mask = offs_m < end
            tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            if r0 < rank:
                if s == 0:
                    a_ptr = a0_ptr
                elif s == 1:
                    a_ptr = a1_ptr
                else:
                    a_ptr = a2_ptr
                offs_r = r0 + tl.arange(0, BLOCK_RANK)
                r_mask = offs_r < rank
                k_lo = pid_k * K_PER_SPLIT
                k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
                if ROWS:
                    a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
                    p_rows = part_ptr + pid_k * stride_ps + start.to(tl.int64) * stride_pm + s * R_PAD + offs_r
                    for m in range(start, end):
                        x_row = x_ptr + tl.load(sorted_token_ptr + m).to(tl.int64) * stride_xt
                        row = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
                        for k0 in range(k_lo, k_hi, BLOCK_K):
                            offs_k = k0 + tl.arange(0, BLOCK_K)
                            k_mask = offs_k < k_hi
                            at = tl.load(a_cols + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                            xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
                            row += tl.sum(at.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
                        tl.store(p_rows + (m - start) * stride_pm, row, mask=r_mask)
                else:
                    x_rows = x_ptr + tok[:, None] * stride_xt
                    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
                    acc = tl.zeros((BLOCK_M, BLOCK_RANK), dtype=tl.float32)
                    for k0 in range(k_lo, k_hi, BLOCK_K):
                        offs_k = k0 + tl.arange(0, BLOCK_K)
                        k_mask = offs_k < k_hi
                        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                        at = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                        if UPCAST:
                            xt = xt.to(tl.float32)
                            at = at.to(tl.float32)
                        acc += _dot(xt, at, IEEE)
                    p = (part_ptr + pid_k * stride_ps + offs_m[:, None].to(tl.int64) * stride_pm + s * R_PAD
                         + offs_r[None, :])
                    tl.store(p, acc, mask=m_mask[:, None] & r_mask[None, :])
            # Every shrink program of a live chunk arrives, with work or without.
            tl.debug_barrier()  # all of this program's partial stores precede the release
            tl.atomic_add(flags + c, 1, sem="release")
    else:
        e = item - N_SHRINK
        c = e // GROUPS
        pid_n = e % GROUPS
        slot = tl.load(chunk_slot_ptr + c)
        start = tl.load(chunk_start_ptr + c)
        end = tl.load(chunk_end_ptr + c)
        if slot >= 0:
            if pid_n < GROUPS0:
                s = 0
                n_lo = pid_n * N_PER_PROG
                out = OUT0
                col0 = 0
                b_ptr = b0_ptr
            elif pid_n < GROUPS0 + GROUPS1:
                s = 1
                n_lo = (pid_n - GROUPS0) * N_PER_PROG
                out = OUT1
                col0 = OUT0
                b_ptr = b1_ptr
            else:
                s = 2
                n_lo = (pid_n - GROUPS0 - GROUPS1) * N_PER_PROG
                out = OUT2
                col0 = OUT0 + OUT1
                b_ptr = b2_ptr
            rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot), tl.minimum(R_MAX, R_PAD))
            offs_m = start + tl.arange(0, BLOCK_M)
            m_mask = offs_m < end
            tok = tl.load(sorted_token_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            scale = tl.load(sorted_scale_ptr + offs_m, mask=m_mask, other=0.0)
            n_hi = tl.minimum(n_lo + N_PER_PROG, out)
            y_rows = y_ptr + tok[:, None] * stride_yt + col0
            if rank == 0:
                if STORE:
                    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
                    for n0 in range(n_lo, n_hi, BLOCK_N):
                        offs_n = n0 + tl.arange(0, BLOCK_N)
                        tl.store(y_rows + offs_n[None, :], zeros, mask=m_mask[:, None] & (offs_n < n_hi)[None, :])
            else:
                offs_r = tl.arange(0, R_BLOCK)
                r_mask = offs_r < rank
                if B_RANK_MAJOR:
                    r_load = r_mask
                    b_base = b_ptr + slot.to(tl.int64) * out * R_MAX + offs_r[:, None].to(tl.int64) * out
                else:
                    r_load = offs_r < (rank + 7) // 8 * 8
                    b_base = b_ptr + slot.to(tl.int64) * out * R_MAX + offs_r[:, None]
                offs_n = n_lo + tl.arange(0, BLOCK_N)
                n_mask = offs_n < n_hi
                bt = _load_b_tile(b_base, offs_n, n_mask, r_mask, r_load, R_MAX, B_RANK_MAJOR, UPCAST)
                mask = m_mask[:, None] & n_mask[None, :]
                if Y_EARLY:
                    cur = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
                else:
                    cur = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                p = part_ptr + offs_m[:, None].to(tl.int64) * stride_pm + s * R_PAD + offs_r[None, :]
                expected = SPLIT_K * N_SR
                while tl.atomic_add(flags + c, 0, sem="acquire") < expected:
                    pass
                h = tl.zeros((BLOCK_M, R_BLOCK), dtype=tl.float32)
                for sp in range(0, SPLIT_K):  # written by other SMs: from L2, not a stale L1 line
                    h += tl.load(p + sp * stride_ps, mask=m_mask[:, None] & r_load[None, :], other=0.0,
                                 cache_modifier=".cg")
                h = tl.where(r_mask[None, :], h * scale[:, None], 0.0)
                if not UPCAST:
                    h = h.to(b0_ptr.dtype.element_ty)
                _write_tile(y_rows + offs_n[None, :], _dot(h, bt, IEEE), mask, cur, Y_EARLY, ATOMIC, STORE)
                for n0 in range(n_lo + BLOCK_N, n_hi, BLOCK_N):
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < n_hi
                    bt = _load_b_tile(b_base, offs_n, n_mask, r_mask, r_load, R_MAX, B_RANK_MAJOR, UPCAST)
                    acc = _dot(h, bt, IEEE)
                    _write_tile(y_rows + offs_n[None, :], acc, m_mask[:, None] & n_mask[None, :], acc, False,
                                ATOMIC, STORE)
            # The chunk's last expand program (every one has seen the flag full) resets its counters.
            if tl.atomic_add(dones + c, 1, sem="relaxed") == GROUPS - 1:
                tl.atomic_xchg(flags + c, 0, sem="relaxed")
                tl.atomic_xchg(dones + c, 0, sem="relaxed")
    if TICKET:  # the last program to finish resets the ticket counter
        if tl.atomic_add(sync_ptr + 32, 1, sem="relaxed") == tl.num_programs(0) - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 32, 0, sem="relaxed")


def new_sync(max_chunks: int, device) -> torch.Tensor:
    """The counters one fused launch at a time may use: zero, and left zero by every launch."""
    return torch.zeros(SYNC_FLAGS.value + 2 * max_chunks, dtype=torch.int32, device=device)


def launch_fused(plan: LoraLaunch, y: torch.Tensor, sync: torch.Tensor, store: bool = False,
                 ticket: bool = True) -> None:
    """What launch_shrink + launch_expand do (no zeroing shrink), in one launch."""
    _check_shapes(y, plan.x, plan.lora_a, plan.lora_b)
    x, meta, cfg, a, b = plan.x, plan.meta, plan.cfg, plan.lora_a, plan.lora_b
    atomic = meta.token_slots.shape[1] > 1
    if store and atomic:
        raise ValueError("a storing expand needs one adapter per token")
    if sync.numel() < SYNC_FLAGS.value + 2 * meta.grid_chunks:
        raise ValueError("sync buffer too small")
    in_features = x.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    n_sr = plan.n_slices * plan.r_blocks
    n_shrink = meta.grid_chunks * cfg.split_k * n_sr
    outs = [t.shape[1] for t in b] + [0] * (3 - plan.n_slices)
    n_per_prog = max(cfg.n_per_prog, cfg.block_n)
    groups = [triton.cdiv(o, n_per_prog) for o in outs]
    r_pad = plan.r_pad
    _lora_fused_kernel[(n_shrink + meta.grid_chunks * sum(groups),)](
        x, *(a + [a[0]] * (3 - plan.n_slices)), *(b + [b[0]] * (3 - plan.n_slices)), y, plan.ranks_device,
        meta.chunk_slot, meta.chunk_start, meta.chunk_end, meta.sorted_token, meta.sorted_scale, plan.part, sync,
        in_features, k_per_split, n_shrink, meta.grid_chunks, outs[0], outs[1], outs[2], groups[0], groups[1],
        sum(groups), cfg.split_k,
        x.stride(0), a[0].stride(0), a[0].stride(1), y.stride(0), plan.ranks_device.stride(0), plan.part.stride(0),
        plan.part.stride(1),
        N_SR=n_sr, R_MAX=plan.r_max, R_PAD=r_pad, R_BLOCKS=plan.r_blocks,
        R_BLOCK=r_pad if r_pad & (r_pad - 1) == 0 else triton.next_power_of_2(r_pad),
        B_RANK_MAJOR=plan.b_rank_major, BLOCK_M=meta.chunk_size, BLOCK_K=cfg.block_k, BLOCK_RANK=16,
        BLOCK_N=cfg.block_n, N_PER_PROG=n_per_prog, UPCAST=plan.upcast, IEEE=plan.ieee, ROWS=cfg.shrink_rows,
        ATOMIC=atomic, STORE=store, Y_EARLY=not (store or atomic), TICKET=ticket, PDL=plan.pdl,
        num_warps=cfg.shrink_warps, num_stages=cfg.num_stages,
    )


def time_case(case, bandwidth: float, g: torch.Generator) -> dict:
    from bench import kernels as kb
    from lorafleet.kernels.lora_ops import add_lora
    from lorafleet.kernels.triton_lora import add_lora_triton, plan_lora_triton

    d_in, outs = kb.MODULES[case.module]
    sets, token_slots, token_scales, ranks = kb.make_case_inputs(case, g)
    meta = kb.case_meta(case, token_slots, token_scales)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    floor = (kb.adapter_bytes(case) + case.tokens * (d_in + 2 * sum(outs)) * kb.BYTES) / bandwidth * 1e6
    row = {"module": case.module, "tokens": case.tokens, "adapters": case.adapters, "rank": case.rank,
           "pool_rank": case.pool_rank, "k": case.k, "floor_us": round(floor, 2),
           "target_us": round(1.3 * floor + 3, 2)}
    sync = new_sync(meta.max_chunks, "cuda")
    inp = sets[0]
    y0 = inp.y.clone()
    ref = y0.clone()
    add_lora(ref, inp.x, inp.lora_a, inp.lora_b, ranks, ranks_dev, meta, backend="torch")
    d_ref = ref.double() - y0.double()

    def fused(s, ticket):
        plan = plan_lora_triton(s.x, s.lora_a, s.lora_b, ranks_dev, meta)
        launch_fused(plan, s.y, sync, ticket=ticket)

    for ticket in (False, True):
        for _ in range(3):  # repeated: the counters must come back to zero each time
            inp.y.copy_(y0)
            fused(inp, ticket)
        err = float(((inp.y.double() - y0.double()) - d_ref).norm() / d_ref.norm())
        row[f"err_{'ticket' if ticket else 'pid'}"] = float(f"{err:.2e}")
        row[f"sync_clean_{'ticket' if ticket else 'pid'}"] = bool((sync == 0).all())
    inp.y.copy_(y0)
    row["two_launches_us"] = round(kb.time_graph(
        [lambda s=s: add_lora_triton(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta) for s in sets]), 2)
    for ticket in (False, True):
        row[f"fused_{'ticket' if ticket else 'pid'}_us"] = round(kb.time_graph(
            [lambda s=s, t=ticket: fused(s, t) for s in sets]), 2)
    row["sync_clean_after"] = bool((sync == 0).all())
    return row


def main() -> None:
    from bench import kernels as kb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(f"{m}:{t}:{a}" for m in kb.MODULES
                                                for t, a in [(16, 1), (16, 8), (64, 8), (64, 64), (256, 8),
                                                             (256, 128)]))
    ap.add_argument("--out", type=Path, default=Path("bench/results/lora-fused-h200.json"))
    args = ap.parse_args()
    bandwidth = kb.measure_copy_bandwidth()
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'case':18} {'target':>7} {'two':>7} {'pid':>7} {'ticket':>7}  err")
    for case in kb.parse_cases(args.cases):
        r = time_case(case, bandwidth, g)
        rows.append(r)
        print(f"{case.module + ':' + str(case.tokens) + ':' + str(case.adapters):18} {r['target_us']:7.2f} "
              f"{r['two_launches_us']:7.2f} {r['fused_pid_us']:7.2f} {r['fused_ticket_us']:7.2f}  "
              f"{r['err_pid']:.1e}/{r['err_ticket']:.1e} clean={r['sync_clean_after']}", flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bandwidth_tb_s": round(bandwidth / 1e12, 3), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Triton kernels for the multi-LoRA side path: a segmented shrink then a segmented expand.

This module checks the inputs, plans and launches; the launch parameters and their choice
(`pick_config`) are in `lorafleet.kernels.lora.config`, the `@triton.jit` programs themselves in
`lorafleet.kernels.lora.programs`.

Semantics (same as `lora_ops.add_lora_reference`):

    for each chunk c (<= chunk_size (token, entry) pairs of one slot, from LoraMeta):
        for each slice s with r = ranks[s, slot] > 0:
            h = x[tokens(c)] @ A_s[slot, :r].T                       # shrink  [rows, r]
            y[tokens(c), cols_s] += (scale(c) * h) @ B_s[slot, :, :r].T  # expand  [rows, out_s]

Two launches per projection group (all slices in each):
- shrink: grid (chunks, SPLIT_K, n_slices * rank_blocks). Each program reduces one K range of
  one 16-wide block of true rank (a row at a time: of the step's rank bound's power of two, when
  that is below 16); blocks past the slot's rank exit before loading anything, so a
  rank-8 adapter in a rank-64 pool reads rank 8. Partials go to `[SPLIT_K, T*k, n_slices*R_PAD]`
  fp32 without atomics; the expand sums them (deterministic, no zeroing launch).
- expand: grid (chunks, column groups of all slices). Sums the partials once, applies each
  pair's scale, then for each BLOCK_N tile of its group multiplies by B's true-rank columns
  (masked loads: the pool's padding is never read; with rank-major B the rows past the true rank
  are not even in the same sectors) and adds into y. With k = 1 every token is in exactly
  one chunk, so a plain read-modify-write is race-free; with k > 1 two chunks can own the same
  row, so the add is atomic. With k = 1 it can also store instead (`launch_expand(store=True)`):
  into a buffer nothing zeroed, whose rows of tokens without an adapter it leaves alone
  (`LoraMeta.has_lora` tells the reader which rows are defined).
- Both run a row at a time instead of `tl.dot` for decode steps of about one pair a chunk
  (`pick_config`'s one_pair: the tuning's shrink_rows, expand_rows).

Rank tiles cover `meta.rank_bound` (the step's largest true rank, set by the caller), not the
pool's r_max, so a step of rank-8 adapters in a rank-64 pool computes and sums rank-8 tiles.
On Hopper and newer the expand is launched with programmatic dependent launch: it starts while
the shrink's programs run, does its prologue (chunk, slot, rank, tokens, scales, its first tile
of B and, when it adds into y non-atomically and the shrink did not zero y, of y), and waits for
the partials with `gdc_wait`. Both kernels issue their loads in as few dependent rounds as they
can: these programs are bound by load latency, which grows when a GEMM beside them keeps memory
busy.

Grids depend only on (T, k, max_slots), the rank bound, the weight shapes and the meta's launch
bound on chunks (`LoraMeta.launch_chunks`: max_chunks unless the caller knows better); padding
chunks (slot -1) exit at once. No host syncs, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from lorafleet.kernels.envs import interpreting
from lorafleet.kernels.lora.config import (
    LoraKernelConfig,
    config_for_meta,
    partial_read_bytes,
    split_sum_code,
)
from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.lora.operands import check_shapes, lora_b_layout
from lorafleet.kernels.lora.programs import _lora_expand_kernel, _lora_shrink_kernel
from lorafleet.kernels.pdl import launch_kwargs as pdl_launch_kwargs
from lorafleet.kernels.pdl import supported_for as pdl_supported_for

BLOCK_R = 16  # rank block of the tl.dot modes: tl.dot's smallest K (and N before Triton 3.5)



@dataclass(slots=True)
class LoraLaunch:
    """One projection group's LoRA launches, planned: `launch_shrink` then `launch_expand`.

    The fp32 split-K partials are allocated on the stream that plans, so both launches may run on
    a side stream (beside the base GEMM, `lora_linear.linear_lora_deferred`) once that stream waits
    for the planning one, which waits for the side stream before it frees them.
    """

    x: torch.Tensor
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    ranks_device: torch.Tensor
    meta: LoraMeta
    cfg: LoraKernelConfig
    part: torch.Tensor
    r_max: int
    r_pad: int
    r_blocks: int
    # The rank tile of the row-at-a-time modes: the step's rank bound rounded up to a power of two
    # (the shrink's at most BLOCK_R, one rank block of the grid). A rank-8 step in a rank-64 pool
    # then holds and multiplies 8 rows, not BLOCK_R = 16 with half masked, which is slower than the
    # same step in a rank-8 pool, whose R_MAX = 8 lets the compiler drop the masked rows
    # (docs/benchmarks.md, "LoRA kernel tuning"). Decode
    # graphs of one-pair steps capture rank classes from 8 up for it (cuda_graphs.rank_class).
    rows_rank: int
    n_slices: int
    b_rank_major: bool
    upcast: bool
    ieee: bool
    pdl: bool
    shrink_zeroes: bool = False  # set by launch_shrink(zero=...): the expand must not read y early


def plan_lora_triton(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks_device: torch.Tensor,
    meta: LoraMeta,
    config: LoraKernelConfig | None = None,
    pdl: bool | None = None,
) -> LoraLaunch | None:
    """Check the inputs and allocate the partials; None when the meta has no chunk to launch for."""
    n_slices = len(lora_a)
    if n_slices > 3:
        raise ValueError(f"at most 3 output slices, got {n_slices}")
    if meta.chunk_slot is None:
        raise ValueError("meta has no chunk list; build it with build_lora_meta")
    num_tokens, in_features = x.shape
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta is for {meta.num_tokens} tokens, x has {num_tokens}")
    if meta.num_chunks > meta.grid_chunks:  # host ints: the chunks past the launch bound would be skipped
        raise ValueError(f"meta has {meta.num_chunks} chunks, but its launches cover {meta.grid_chunks}")
    if meta.grid_chunks == 0:
        return None
    r_max = lora_a[0].shape[1]
    if any(a.shape[1] != r_max for a in lora_a) or r_max == 0:
        raise ValueError("all slices need the same, non-zero r_max")
    if ranks_device is None or tuple(ranks_device.shape) != (n_slices, lora_a[0].shape[0]):
        raise ValueError(f"ranks_device must be [n_slices={n_slices}, S={lora_a[0].shape[0]}] int32")
    if x.stride(1) != 1:
        raise ValueError("x needs unit stride along features")
    lora_a = [a if a.is_contiguous() else a.contiguous() for a in lora_a]
    layouts = {lora_b_layout(b) for b in lora_b}
    if layouts not in ({"rank_major"}, {"out_major"}):  # mixed or odd strides: copy (slow path)
        lora_b = [b.contiguous() for b in lora_b]
        layouts = {"out_major"}
    interp = interpreting()
    if pdl is None:
        pdl = pdl_supported_for(x)
    cfg = config or config_for_meta(meta, n_slices, in_features)
    # Rank tiles cover the step's largest true rank (meta.rank_bound), not the pool's r_max; the
    # partials keep BLOCK_R-multiple columns (tl.dot's), the row-at-a-time modes, which need no
    # tl.dot, tiles of only the bound's power of two (`rows_rank`, see LoraLaunch).
    r_eff = r_max if meta.rank_bound is None else max(1, min(r_max, meta.rank_bound))
    r_blocks = triton.cdiv(r_eff, BLOCK_R)
    r_pad = r_blocks * BLOCK_R
    num_pairs = num_tokens * meta.token_slots.shape[1]
    part = torch.empty((cfg.split_k, num_pairs, n_slices * r_pad), dtype=torch.float32, device=x.device)
    return LoraLaunch(
        x=x, lora_a=lora_a, lora_b=list(lora_b), ranks_device=ranks_device.to(torch.int32).contiguous(),
        meta=meta, cfg=cfg, part=part, r_max=r_max, r_pad=r_pad, r_blocks=r_blocks,
        rows_rank=triton.next_power_of_2(r_eff), n_slices=n_slices,
        b_rank_major=layouts == {"rank_major"}, upcast=interp or x.dtype == torch.float32,
        ieee=x.dtype == torch.float32 and not interp, pdl=pdl,
    )


def launch_shrink(plan: LoraLaunch, zero: torch.Tensor | None = None) -> None:
    """part[split, pair, s*R_PAD + r] = Σ_k x[token(pair), k] · A_s[slot, r, k] (on the current stream).

    zero: a contiguous buffer the same launch fills with zeros first (the delta `launch_expand`
    will accumulate into), instead of a memset launch before it.
    """
    if zero is not None and not zero.is_contiguous():
        raise ValueError("the buffer to zero must be contiguous")
    x, meta, cfg, a = plan.x, plan.meta, plan.cfg, plan.lora_a
    plan.shrink_zeroes = zero is not None
    in_features = x.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (meta.grid_chunks, cfg.split_k, plan.n_slices * plan.r_blocks)
    if zero is not None and zero.numel() + grid[0] * grid[1] * grid[2] * 1024 >= 2**31:  # int32 offsets
        raise ValueError(f"the buffer to zero is too large for one launch ({zero.numel()} elements)")
    _lora_shrink_kernel[grid](
        x,
        *(a + [a[0]] * (3 - plan.n_slices)),
        plan.ranks_device,
        meta.chunk_slot,
        meta.chunk_start,
        meta.chunk_end,
        meta.sorted_token,
        plan.part,
        plan.part if zero is None else zero,
        in_features,
        k_per_split,
        0 if zero is None else zero.numel(),
        x.stride(0),
        a[0].stride(0),
        a[0].stride(1),
        plan.ranks_device.stride(0),
        plan.part.stride(0),
        plan.part.stride(1),
        R_MAX=plan.r_max,
        R_PAD=plan.r_pad,
        R_BLOCKS=plan.r_blocks,
        BLOCK_M=meta.chunk_size,
        BLOCK_K=cfg.block_k,
        BLOCK_RANK=min(plan.rows_rank, BLOCK_R) if cfg.shrink_rows else BLOCK_R,
        UPCAST=plan.upcast,
        IEEE=plan.ieee,
        PDL=plan.pdl,
        ZERO=zero is not None,
        ZERO_BLOCK=1024,
        ROWS=cfg.shrink_rows,
        META_ROUND=cfg.meta_round,
        num_warps=cfg.shrink_warps,
        num_stages=cfg.num_stages,
    )


def launch_expand(plan: LoraLaunch, y: torch.Tensor, store: bool = False) -> None:
    """y[token(pair), slice cols] += scale(pair) · B_s(Σ_splits part), in place (on the current stream).

    store: `=` instead of `+=` (one adapter per token only), so y need not be zeroed first and is
    not read; rows of tokens without an adapter are not written (`LoraMeta.has_lora` tells them).
    """
    check_shapes(y, plan.x, plan.lora_a, plan.lora_b)
    if y.stride(1) != 1:
        raise ValueError("y needs unit stride along features")
    meta, cfg, b = plan.meta, plan.cfg, plan.lora_b
    atomic = meta.token_slots.shape[1] > 1
    if store and (atomic or plan.shrink_zeroes):
        raise ValueError("a storing expand needs one adapter per token (k = 1) and a shrink that does not zero y")
    outs = [t.shape[1] for t in b] + [0] * (3 - plan.n_slices)
    n_per_prog = max(cfg.n_per_prog, cfg.block_n)
    groups = [triton.cdiv(o, n_per_prog) for o in outs]
    r_pad = plan.r_pad
    _lora_expand_kernel[(meta.grid_chunks, sum(groups))](
        y,
        *(b + [b[0]] * (3 - plan.n_slices)),
        plan.ranks_device,
        meta.chunk_slot,
        meta.chunk_start,
        meta.chunk_end,
        meta.sorted_token,
        meta.sorted_scale,
        plan.part,
        outs[0],
        outs[1],
        outs[2],
        groups[0],
        groups[1],
        cfg.split_k,
        y.stride(0),
        plan.ranks_device.stride(0),
        plan.part.stride(0),
        plan.part.stride(1),
        R_MAX=plan.r_max,
        R_PAD=r_pad,
        R_BLOCK=plan.rows_rank if cfg.expand_rows else triton.next_power_of_2(r_pad),
        B_RANK_MAJOR=plan.b_rank_major,
        BLOCK_M=meta.chunk_size,
        BLOCK_N=cfg.block_n,
        N_PER_PROG=n_per_prog,
        UPCAST=plan.upcast,
        IEEE=plan.ieee,
        ATOMIC=atomic,
        Y_EARLY=not (plan.shrink_zeroes or store or atomic),
        STORE=store,
        ROWS=cfg.expand_rows,
        AHEAD=cfg.expand_ahead,
        SPLIT_SUM=split_sum_code(cfg.split_sum, cfg.split_k, partial_read_bytes(
            meta.num_chunks, sum(groups), cfg.split_k, 1 if cfg.expand_rows else meta.chunk_size, r_pad)),
        META_ROUND=cfg.meta_round,
        num_warps=cfg.expand_warps,
        num_stages=cfg.num_stages,
        **({} if cfg.expand_maxnreg is None else {"maxnreg": cfg.expand_maxnreg}),
        **pdl_launch_kwargs(plan.pdl),
    )


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks_device: torch.Tensor,
    meta: LoraMeta,
    config: LoraKernelConfig | None = None,
    pdl: bool | None = None,
) -> None:
    """y[:, slices] += Σ scale · B(A x), in place: a shrink launch, then an expand launch.

    y: `[T, Σ out_s]`; x: `[T, in]`; lora_a[s]: `[S, r_max, in]`; lora_b[s]: indexed
    `[S, out_s, r_max]`, out-major or rank-major memory (`operands.new_lora_b`); ranks_device:
    `[n_slices, S]` int32 on y's device. Launches even when no token has an adapter (the programs
    exit at once), so a graph captured on any step replays correctly on the next.
    config: launch parameters; default `pick_config` on the host-side meta. Any config accepts any
    meta of the same shapes, so a graph captured with one step's choice replays correctly with
    another step's metadata.
    pdl: launch the expand with programmatic dependent launch (it starts while the shrink runs
    and waits for the partials with `gdc_wait`); None = where supported (`pdl.pdl_supported`).
    """
    plan = plan_lora_triton(x, lora_a, lora_b, ranks_device, meta, config, pdl)
    if plan is None:  # nothing to launch; the shapes are still checked (launch_expand does it otherwise)
        check_shapes(y, x, lora_a, lora_b)
        return
    launch_shrink(plan)
    launch_expand(plan, y)

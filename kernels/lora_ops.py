"""Multi-LoRA side path for one batch: metadata built once per step, applied by every layer.

Semantics (for every LoRA-targeted linear with output slices s = 0..n-1, column offsets c_s):

    for t in tokens:
        for j in 0..k-1:                       # up to k adapters per token (the RFC)
            slot, scale = token_slots[t, j], token_scales[t, j]
            if slot < 0: continue
            for s in slices:
                r = ranks[s, slot]             # the slot's true rank for this slice (0 = untargeted)
                y[t, c_s : c_s + out_s] += scale * B_s[slot, :, :r] @ (A_s[slot, :r, :] @ x[t])

The adapter's own alpha/r (or alpha/sqrt(r) for rsLoRA) is folded into B when a slot is filled, so
`scale` is the request's static scale (1.0 for a plain single-adapter request).

Layouts: A_s `[S, r_max, in]`, B_s `[S, out_s, r_max]`, `ranks` `[n_slices, S]` int32. Work and
bytes read follow each slot's true rank, never `r_max`. B_s is indexed as `[S, out_s, r_max]`, but
its memory may be out-major (contiguous) or rank-major (`new_lora_b`: `[S, r_max, out_s]` storage,
what the slot pool uses): rank-major keeps a slot's true-rank rows contiguous, so a rank-8 adapter
in a rank-64 pool reads 8 full rows instead of 16 bytes out of every 128-byte row.

The torch reference here is the CPU path and the oracle for the Triton kernels in
`lorafleet.kernels.triton_lora`, which take the same arguments.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class LoraMeta:
    """The step's token -> (slot, scale) mapping, sorted and segmented by slot.

    Device tensors have fixed shapes for a given (num_tokens, k, max_slots), so a captured CUDA
    graph can replay with new contents. `segments` is the same information on the host, used by
    the torch reference (which launches per segment anyway).
    """

    token_slots: torch.Tensor  # [T, k] int32, -1 = no adapter
    token_scales: torch.Tensor  # [T, k] float32
    sorted_token: torch.Tensor  # [T*k] int32: token of each (token, entry) pair, sorted by slot
    sorted_scale: torch.Tensor  # [T*k] float32: that pair's scale
    seg_slot: torch.Tensor  # [max_slots] int32: slot of each segment, -1 past num_segments
    seg_start: torch.Tensor  # [max_slots + 1] int32: segment offsets into sorted_*; padded with num_entries
    num_segments: int
    num_entries: int  # valid (slot >= 0) pairs; sorted_* past it are padding
    max_slots: int
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end) on the host
    # Each segment cut into chunks of at most `chunk_size` pairs: one Triton program row-block each.
    # Fixed shape [max_chunks]; entries past num_chunks have chunk_slot -1 (those programs exit).
    chunk_size: int = 16
    chunk_slot: torch.Tensor | None = None  # [max_chunks] int32, -1 = padding
    chunk_start: torch.Tensor | None = None  # [max_chunks] int32: first pair of the chunk in sorted_*
    chunk_end: torch.Tensor | None = None  # [max_chunks] int32: one past its last pair
    num_chunks: int = 0
    max_chunks: int = 0
    longest_chunk: int = 0  # pairs in the fullest chunk (host)
    # Host: chunk rows the Triton kernels launch (active chunks come first). None: max_chunks, so a
    # CUDA graph captured with this meta replays correctly with any meta of the same shapes. A
    # one-off launch sets num_chunks; DecodeGraphs sets its chunk class, and `copy_` refuses a meta
    # with more chunks than that. Padding programs exit at once but are not free: at 8 adapters in
    # a 64-token step, max_chunks launches 4x the programs that do work.
    launch_chunks: int | None = None
    # Host: no slot of this step has a true rank above this (None: up to the pool's r_max). The
    # Triton kernels size their rank tiles by it, so rank-8 adapters in a rank-64 pool do rank-8
    # work; whoever sets it must make sure it holds (ModelRunner: the slots' largest ranks).
    rank_bound: int | None = None
    # The device buffers every tensor above is a view of (build_lora_meta): (int32, float32).
    packed: tuple[torch.Tensor, torch.Tensor] | None = None
    # [T] int32: 1 where the token has at least one adapter. A side path's delta written by a
    # storing expand (`linear_lora_deferred`) is defined only on those rows: its readers mask with it.
    has_lora: torch.Tensor | None = None
    # Host: the step has one-pair chunks (`one_pair_chunks`), so the Triton shrink runs a row at a
    # time. None: judged from this meta's own counts. DecodeGraphs sets it from each step's: its
    # graphs' num_chunks is a class, which 32 chunks of two pairs share with 64 of one.
    one_pair: bool | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def empty(self) -> bool:
        return self.num_entries == 0

    @property
    def one_pair_chunks(self) -> bool:
        """More than ONE_PAIR_MIN_CHUNKS chunks of at most ONE_PAIR_CHUNKS[0] pairs on average and
        ONE_PAIR_CHUNKS[1] at most (decode with about as many adapters as tokens); `one_pair` when set."""
        if self.one_pair is not None:
            return self.one_pair
        return (self.num_chunks > ONE_PAIR_MIN_CHUNKS and self.num_entries <= ONE_PAIR_CHUNKS[0] * self.num_chunks
                and self.longest_chunk <= ONE_PAIR_CHUNKS[1])

    @property
    def grid_chunks(self) -> int:
        """Chunk rows of the kernels' grids (see `launch_chunks`)."""
        return self.max_chunks if self.launch_chunks is None else min(self.max_chunks, self.launch_chunks)

    def copy_(self, other: LoraMeta) -> None:
        """Copy `other`'s contents into this meta's device buffers, in place.

        For CUDA graphs: capture with one meta, then `copy_` each step's meta into it before replay.
        Both must come from the same (T, k, max_slots, chunk_size).
        """
        shape_keys = (self.num_tokens, self.token_slots.shape[1], self.max_slots, self.chunk_size, self.max_chunks)
        other_keys = (other.num_tokens, other.token_slots.shape[1], other.max_slots, other.chunk_size, other.max_chunks)
        if shape_keys != other_keys:
            raise ValueError(f"meta shapes differ: {shape_keys} vs {other_keys}")
        if self.packed is None or other.packed is None:
            raise ValueError("copy_ needs metas made by build_lora_meta (their two packed buffers)")
        if other.num_chunks > self.grid_chunks:
            raise ValueError(f"{other.num_chunks} chunks, but this meta's launches cover {self.grid_chunks}")
        for dst, src in zip(self.packed, other.packed, strict=True):  # same layout: two copies
            dst.copy_(src, non_blocking=True)
        self.num_segments = other.num_segments
        self.num_entries = other.num_entries
        self.segments = list(other.segments)
        self.num_chunks = other.num_chunks
        self.longest_chunk = other.longest_chunk


# One-pair chunks (`LoraMeta.one_pair_chunks`): more than ONE_PAIR_MIN_CHUNKS of them, at most
# ONE_PAIR_CHUNKS[0] pairs each on average and none over ONE_PAIR_CHUNKS[1] (the row-at-a-time shrink
# walks a chunk's rows one after another: a long one would set the launch's time). In the engine at
# batch 64 (docs/benchmarks.md, eighth session) that shrink took 64 adapters (one pair a chunk)
# 0.752 -> 0.760 of base-only, and 32 adapters (two) 0.851 -> 0.840; alone, chunks of 8 pairs
# (8 adapters) ran it 2.1-2.8x slower than the tl.dot shrink. (Up to 16 chunks it is never used.)
ONE_PAIR_CHUNKS = (1.5, 2)
ONE_PAIR_MIN_CHUNKS = 16


def default_chunk_size(num_pairs: int) -> int:
    """Rows per Triton program: small for decode (few tokens per adapter), larger for prefill."""
    return 16 if num_pairs <= 512 else 64


def max_chunks_for(num_pairs: int, max_slots: int, chunk_size: int) -> int:
    """Upper bound on chunks: each segment adds at most one partial chunk, and no chunk is empty."""
    if num_pairs == 0:
        return 0
    return min(num_pairs, -(-num_pairs // chunk_size) + min(max_slots, num_pairs))


def build_lora_meta(
    token_slots: torch.Tensor,
    token_scales: torch.Tensor,
    max_slots: int,
    device: torch.device | str = "cpu",
    chunk_size: int | None = None,
) -> LoraMeta:
    """Sort the step's (token, entry) pairs by slot on the host and move them to `device` once.

    token_slots: `[T, k]` int (CPU), -1 = none; token_scales: `[T, k]` float (CPU).
    chunk_size: pairs per Triton program (a power of two >= 16); default from T*k.
    Host work is numpy (a decode step's host time is what the GPU waits for); the device tensors
    are views of one int32 and one float32 buffer, each moved in a single copy.
    """
    if token_slots.shape != token_scales.shape or token_slots.dim() != 2:
        raise ValueError(f"token_slots {tuple(token_slots.shape)} and token_scales {tuple(token_scales.shape)} must both be [T, k]")
    num_tokens, k = token_slots.shape
    slots = token_slots.numpy().astype(np.int64).reshape(-1)
    scales = token_scales.numpy().astype(np.float32).reshape(-1)
    if slots.size and int(slots.max()) >= max_slots:
        raise ValueError(f"slot {int(slots.max())} out of range for {max_slots} slots")
    # Invalid pairs sort last; a stable sort keeps tokens in order inside a segment.
    keys = np.where(slots >= 0, slots, max_slots)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    num_entries = int(np.count_nonzero(sorted_keys < max_slots))
    valid = sorted_keys[:num_entries]
    firsts = np.flatnonzero(np.diff(valid, prepend=-1)) if num_entries else np.zeros(0, dtype=np.int64)
    active = valid[firsts]
    counts = np.diff(np.append(firsts, num_entries))
    num_segments = active.size
    seg_start = np.full(max_slots + 1, num_entries, dtype=np.int64)
    seg_start[0] = 0
    seg_start[1 : num_segments + 1] = np.cumsum(counts)
    segments = [(int(active[i]), int(seg_start[i]), int(seg_start[i + 1])) for i in range(num_segments)]

    num_pairs = slots.size
    chunk_size = chunk_size or default_chunk_size(num_pairs)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size {chunk_size} must be a power of two >= 16")
    max_chunks = max_chunks_for(num_pairs, max_slots, chunk_size)
    # Chunk c of segment i covers pairs [seg_start[i] + c*chunk_size, min(+chunk_size, seg_end)).
    per_seg = (counts + chunk_size - 1) // chunk_size
    num_chunks = int(per_seg.sum())
    chunk_seg = np.repeat(np.arange(num_segments), per_seg)
    within = np.arange(num_chunks) - (np.cumsum(per_seg) - per_seg)[chunk_seg]
    begin = seg_start[:num_segments][chunk_seg] + within * chunk_size

    # One int32 buffer: token_slots | sorted_token | seg_slot | seg_start | chunk_slot | chunk_start | chunk_end
    # | has_lora
    sizes = [num_pairs, num_pairs, max_slots, max_slots + 1, max_chunks, max_chunks, max_chunks, num_tokens]
    ints = np.zeros(sum(sizes), dtype=np.int32)
    parts = np.split(ints, np.cumsum(sizes)[:-1])
    parts[0][:] = slots
    parts[1][:] = order // max(k, 1)
    parts[2][:] = -1
    parts[2][:num_segments] = active
    parts[3][:] = seg_start
    parts[4][:] = -1
    parts[4][:num_chunks] = active[chunk_seg]
    parts[5][:num_chunks] = begin
    parts[6][:num_chunks] = np.minimum(begin + chunk_size, seg_start[1 : num_segments + 1][chunk_seg])
    parts[7][:] = (slots.reshape(num_tokens, k) >= 0).any(axis=1) if k else 0
    floats = np.concatenate([scales, scales[order]])
    ints_d = torch.from_numpy(ints).to(device, non_blocking=True)
    floats_d = torch.from_numpy(floats).to(device, non_blocking=True)
    views = torch.split(ints_d, sizes)
    return LoraMeta(
        token_slots=views[0].view(num_tokens, k),
        token_scales=floats_d[:num_pairs].view(num_tokens, k),
        sorted_token=views[1],
        sorted_scale=floats_d[num_pairs:],
        seg_slot=views[2],
        seg_start=views[3],
        num_segments=num_segments,
        num_entries=num_entries,
        max_slots=max_slots,
        segments=segments,
        chunk_size=chunk_size,
        chunk_slot=views[4],
        chunk_start=views[5],
        chunk_end=views[6],
        num_chunks=num_chunks,
        max_chunks=max_chunks,
        longest_chunk=min(chunk_size, int(counts.max())) if num_segments else 0,
        packed=(ints_d, floats_d),
        has_lora=views[7],
    )


def new_lora_b(
    num_slots: int, out: int, r_max: int, *, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """A zeroed B stack indexed `[S, out, r_max]` with rank-major memory (`[S, r_max, out]` storage).

    A slot's rank-r rows are then one contiguous block of r·out values; write them through the
    view (`b[slot, :, :r].copy_(m.b)`) or the storage (`b.transpose(1, 2)[slot, :r].copy_(m.b.T)`).
    """
    return torch.zeros(num_slots, r_max, out, device=device, dtype=dtype).transpose(1, 2)


def lora_b_layout(b: torch.Tensor) -> str | None:
    """"out_major" (contiguous `[S, out, r_max]`), "rank_major" (`new_lora_b`), or None (other strides)."""
    _, out, r_max = b.shape
    if b.stride(0) != out * r_max:
        return None
    if b.stride(1) == 1 and b.stride(2) == out:
        return "rank_major"
    if b.stride(2) == 1 and b.stride(1) == r_max:
        return "out_major"
    return None


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks: Sequence[Sequence[int]],
    meta: LoraMeta,
) -> None:
    """y[:, slices] += Σ scale · B(A x), in place; one small matmul pair per (segment, slice).

    y: `[T, Σ out_s]`; x: `[T, in]`; lora_a[s]: `[S, r_max, in]`; lora_b[s]: `[S, out_s, r_max]`;
    ranks: host `[n_slices][S]` true ranks (0 = this slot does not target this slice).
    """
    _check_shapes(y, x, lora_a, lora_b)
    if meta.empty:
        return
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    for slot, start, end in meta.segments:
        rows = meta.sorted_token[start:end].long()
        scale = meta.sorted_scale[start:end].to(compute).unsqueeze(1)  # [n, 1]
        xs = x.index_select(0, rows).to(compute)  # [n, in]
        col = 0
        for a, b, slice_ranks in zip(lora_a, lora_b, ranks):
            out = b.shape[1]
            r = slice_ranks[slot]
            if r:
                shrunk = xs @ a[slot, :r].to(compute).T  # [n, r]
                delta = (shrunk * scale) @ b[slot, :, :r].to(compute).T  # [n, out]
                y[:, col : col + out].index_add_(0, rows, delta.to(y.dtype))
            col += out


def _check_shapes(
    y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]
) -> None:
    if len(lora_a) != len(lora_b) or not lora_a:
        raise ValueError("lora_a and lora_b need the same, non-zero number of slices")
    total_out = sum(b.shape[1] for b in lora_b)
    if y.shape != (x.shape[0], total_out):
        raise ValueError(f"y {tuple(y.shape)} must be [T={x.shape[0]}, Σout={total_out}]")
    for a, b in zip(lora_a, lora_b):
        if a.shape[2] != x.shape[1] or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
            raise ValueError(f"slice shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit x {tuple(x.shape)}")


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks: Sequence[Sequence[int]],
    ranks_device: torch.Tensor | None,
    meta: LoraMeta,
    backend: str = "torch",
) -> None:
    """Dispatch to the torch reference or the Triton kernels (same semantics).

    ranks_device: `[n_slices, S]` int32 on y's device (the Triton path reads ranks there, so a
    captured graph sees slot changes without re-capture).
    """
    if backend == "torch":
        add_lora_reference(y, x, lora_a, lora_b, ranks, meta)
    elif backend == "triton":
        from lorafleet.kernels.triton_lora import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, ranks_device, meta)
    else:
        raise ValueError(f"unknown LoRA backend {backend!r} (torch | triton)")


# The side path runs beside the GEMM up to OVERLAP_MAX_CHUNKS chunks (default: always), and a
# decode-sized GEMM beside it (at most CARVEOUT_MAX_TOKENS rows: memory-bound, so it keeps its
# bandwidth on fewer SMs) leaves SMs free for the LoRA kernels (cuBLASLt's SM count target; cuBLAS
# ignores it): GEMM_SM_CARVEOUT[0] for a launch of at most FEW_CHUNKS chunks, [1] above, beside a
# GEMM under LARGE_GEMM_ELEMENTS weight elements; [2] and [3] likewise beside a larger one. With one
# adapter per token the expand stores the delta (DELTA_STORE: nothing zeroes it); otherwise, above
# FEW_CHUNKS the shrink's programs zero it instead of a memset launch before them. Above FEW_CHUNKS
# the side path runs beside only decode-sized GEMMs (prefill steps with many chunks: after the GEMM,
# as measured before). Carveouts are capped at CARVEOUT_MAX_SHARE of the GPU's SMs.
# Measured on the H200 at batch 64 (docs/benchmarks.md, tokens/s vs base-only): without a carveout
# the LoRA kernels wait for the GEMM's last CTAs, and beside the GEMM lost to after it with 64
# adapters (0.617 vs 0.645); with 32 SMs free it won (0.66). With 64 adapters the zeroing shrink
# then took 0.653 -> 0.674 and 48 SMs 0.689. The storing expand with the GEMM launched first
# (sixth session): 8 adapters 0.89 -> 0.92, 64 adapters 0.69 -> 0.73; then 48 SMs beside every GEMM
# up to FEW_CHUNKS (8 adapters 0.928, 1 adapter 0.957) and 80 beside the small GEMMs above it, where
# qkv's LoRA outlasts its GEMM (32 and 64 adapters +0.011). 8 adapters in a 64-token step launch 16
# chunks, 64 adapters 64.
OVERLAP_MAX_CHUNKS = int(os.environ.get("LORAFLEET_OVERLAP_MAX_CHUNKS", str(1 << 30)))
FEW_CHUNKS = 16


def _carveouts(text: str) -> tuple[int, int, int, int]:
    """LORAFLEET_GEMM_SM_CARVEOUT: SMs for (few, many) chunks beside a small GEMM, then beside a
    large one (LARGE_GEMM_ELEMENTS): "a,b,c,d"; "few,many" ("32,48") for both sizes; or one number
    ("48")."""
    try:
        parts = [int(v) for v in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2, 4) or min(parts) < 0:
        raise ValueError(f"LORAFLEET_GEMM_SM_CARVEOUT must be N, N,M or A,B,C,D (SMs >= 0), got {text!r}")
    return carveout_table(parts)


def carveout_table(parts: Sequence[int]) -> tuple[int, int, int, int]:
    """1, 2 or 4 carveouts -> (few small, many small, few large, many large)."""
    if len(parts) == 1:
        return (parts[0],) * 4
    if len(parts) == 2:
        return parts[0], parts[1], parts[0], parts[1]
    if len(parts) == 4:
        return tuple(parts)
    raise ValueError(f"1, 2 or 4 carveouts, got {len(parts)}")


GEMM_SM_CARVEOUT = _carveouts(os.environ.get("LORAFLEET_GEMM_SM_CARVEOUT", "48,80,48,48"))
CARVEOUT_MAX_SHARE = 5 / 8  # of the GPU's SMs; the rest stay with the GEMM (82 of the H200's 132)
LARGE_GEMM_ELEMENTS = 1 << 25  # weight elements: at the seed shape gate_up and down are large, qkv and o small
CARVEOUT_MAX_TOKENS = 128
# Whether the GEMM is launched before the LoRA kernels beside it, with at most and above FEW_CHUNKS
# chunks. LoRA kernels launched first fill every SM with their programs, and the GEMM's CTAs
# wait for them to drain (the H200's step timeline at 64 adapters: ~1.1 ms a step of GEMMs
# starting late); a GEMM launched first takes its SMs and leaves the carveout to the LoRA. Alone it
# won little on the H200 (64 adapters 0.684 -> 0.689, overlap-sweep-gemm-first-h200.json), and at
# few chunks neither it nor the storing expand won alone (8 adapters 0.89 -> 0.891 and 0.897 ->
# 0.887); together they did (0.922; overlap-sweep-store2-h200.json, overlap-sweep-store-h200.json).
GEMM_FIRST = (True, True)
ZERO_IN_SHRINK = True  # above FEW_CHUNKS, unless the expand stores (False: a memset; benchmarks compare)
# With one adapter per token, whether the expand stores the delta (no memset or zeroing shrink
# before it, no read of it; its reader masks the rows of tokens without an adapter with
# LoraMeta.has_lora), with at most and above FEW_CHUNKS chunks.
DELTA_STORE = (True, True)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _carveout(device: torch.device, many: bool, large: bool) -> int:
    """GEMM_SM_CARVEOUT (tuned on the H200's 132 SMs), at most CARVEOUT_MAX_SHARE of this GPU's
    SMs: a smaller GPU keeps most of its SMs for the GEMM."""
    return min(GEMM_SM_CARVEOUT[2 * large + many], int(_sm_count(device) * CARVEOUT_MAX_SHARE))


@contextlib.contextmanager
def gemm_sm_carveout(sms: int) -> Iterator[None]:
    """cuBLASLt GEMMs issued inside leave `sms` SMs free for kernels on other streams (no-op for 0
    or where torch lacks the setting). A captured graph keeps the GEMM kernel chosen then."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if sms <= 0 or setter is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    setter(sms)
    try:
        yield
    finally:
        setter(before)


def linear_lora_deferred(
    base: Callable[[], torch.Tensor],
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks: Sequence[Sequence[int]],
    ranks_device: torch.Tensor | None,
    meta: LoraMeta,
    backend: str = "torch",
    side_stream: torch.cuda.Stream | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`base()` (the base projection of x) and the LoRA side path -> (y, delta).

    With the Triton backend, a side stream and at most OVERLAP_MAX_CHUNKS chunks to launch for
    (above FEW_CHUNKS, decode-sized steps only), the whole side path runs on the side stream while
    the base GEMM runs: zero a delta buffer (a memset, or the shrink's programs above FEW_CHUNKS),
    shrink, expand into the delta. The current stream waits for the side stream before
    returning, and the caller adds the delta where it reads y anyway (the fused row kernels'
    `delta` argument), so in a decode step the small, latency-bound LoRA launches hide behind the
    GEMM's weight reads instead of following it. A decode-sized GEMM leaves GEMM_SM_CARVEOUT SMs
    to them (a GEMM that fills every SM makes them wait for its last CTAs). CUDA-graph capture
    records the fork and the join as graph edges.
    Not beside the GEMM (another backend, no side stream, too many chunks), the LoRA is added into
    y in place and delta is None.
    With one adapter per token (and DELTA_STORE) the expand stores into the delta instead of adding
    into a zeroed one: nothing zeroes it, and its rows of tokens without an adapter are left
    undefined, so the reader masks them with `meta.has_lora` (the fused row kernels' `delta_rows`).
    """
    beside = meta.grid_chunks <= OVERLAP_MAX_CHUNKS and (
        meta.grid_chunks <= FEW_CHUNKS or x.shape[0] <= CARVEOUT_MAX_TOKENS)  # many chunks: decode steps only
    if backend != "triton" or side_stream is None or not beside:
        y = base()
        add_lora(y, x, lora_a, lora_b, ranks, ranks_device, meta, backend)
        return y, None
    from lorafleet.kernels.triton_lora import launch_expand, launch_shrink, plan_lora_triton

    plan = plan_lora_triton(x, lora_a, lora_b, ranks_device, meta)
    if plan is None:
        return base(), None
    # Allocated on the current stream, so the caching allocator never hands these buffers to the
    # side stream's next request while the current stream still reads them.
    delta = torch.empty((x.shape[0], sum(b.shape[1] for b in lora_b)), dtype=x.dtype, device=x.device)
    main = torch.cuda.current_stream(x.device)
    many = meta.grid_chunks > FEW_CHUNKS
    large = x.shape[1] * delta.shape[1] >= LARGE_GEMM_ELEMENTS
    carveout = _carveout(x.device, many, large) if x.shape[0] <= CARVEOUT_MAX_TOKENS else 0
    gemm_first = GEMM_FIRST[many]
    inputs_ready = torch.cuda.Event()
    inputs_ready.record(main)
    side_stream.wait_event(inputs_ready)  # x, not the GEMM; before the try, so the join is well-formed
    y = None
    try:
        if gemm_first:  # launched (and, in a graph, made a node) first: its CTAs are placed before the LoRA's
            with gemm_sm_carveout(carveout):
                y = base()
        with torch.cuda.stream(side_stream):
            store = DELTA_STORE[many] and meta.token_slots.shape[1] == 1 and meta.has_lora is not None
            zero_in_shrink = ZERO_IN_SHRINK and many and not store
            if not (store or zero_in_shrink):
                delta.zero_()
            launch_shrink(plan, zero=delta if zero_in_shrink else None)
            launch_expand(plan, delta, store)  # programmatic dependent launch after the shrink where supported
        if not gemm_first:
            with gemm_sm_carveout(carveout):
                y = base()
    finally:  # joined even when a launch or the GEMM raises: the buffers must not be reused early
        main.wait_stream(side_stream)
    return y, delta


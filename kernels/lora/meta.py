"""Step metadata for the multi-LoRA side path: built once per step, read by every LoRA layer.

`build_lora_meta` sorts the step's (token, entry) pairs by slot on the host, cuts them into
segments (one per active slot) and chunks (one Triton program row-block each), and moves the
result to the device in two copies. The torch reference (`lorafleet.kernels.lora.ops`) walks the
host segments; the Triton kernels (`lorafleet.kernels.lora.launch`) launch over the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lorafleet.kernels.lora.tuning import LoraTuning, active_tuning


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
        """`one_pair_chunks_for` the process's LoRA tuning."""
        return self.one_pair_chunks_for(active_tuning())

    def one_pair_chunks_for(self, tuning: LoraTuning) -> bool:
        """More than tuning.one_pair_min_chunks chunks of at most tuning.one_pair_chunks[0] pairs on
        average and one_pair_chunks[1] at most (decode with about as many adapters as tokens: the
        row-at-a-time shrink walks a chunk's rows one after another, so a long chunk would set the
        launch's time); `one_pair` when set."""
        if self.one_pair is not None:
            return self.one_pair
        average, longest = tuning.one_pair_chunks
        return (self.num_chunks > tuning.one_pair_min_chunks and self.num_entries <= average * self.num_chunks
                and self.longest_chunk <= longest)

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

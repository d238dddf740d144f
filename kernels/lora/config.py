"""The LoRA kernels' launch parameters: `LoraKernelConfig`, and `pick_config`'s choice of them for a
step (its chunks, chunk size, slices and K), with the module-level knobs that choice reads.

Each knob's comment says what was measured on the H200 for it, alone and in the engine; benches
set them here to compare settings (`bench/knob_ab.py` alone, `bench/overlap_sweep.py` in the
engine). `lorafleet.kernels.lora.launch` plans and launches with a config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from lorafleet.kernels.lora.meta import LoraMeta


@dataclass(frozen=True, slots=True)
class LoraKernelConfig:
    """Launch parameters; `pick_config` chooses them per call (a captured graph keeps its own)."""

    split_k: int
    block_k: int
    block_n: int
    n_per_prog: int = 512
    shrink_warps: int = 4
    expand_warps: int = 4
    num_stages: int = 3
    shrink_rows: bool = False  # the shrink's multiply-and-sum a row (lora_kernels, ROWS) instead of tl.dot
    expand_rows: bool = False  # the expand's likewise, one B tile a program (n_per_prog == block_n)
    expand_maxnreg: int | None = None  # registers a thread the expand may hold (ptxas' cap); None = its choice
    expand_ahead: bool = False  # the tl.dot expand loads each next tile before writing this one (lora_kernels, AHEAD)
    split_sum: str = "unroll"  # how the expand sums the K splits' partials: "loop" or "unroll" (split_sum_code)
    meta_round: bool = False  # both kernels load a chunk's slot, start and end in one round (lora_kernels, META_ROUND)

    def __post_init__(self) -> None:
        # Checked here, not by Triton: the interpreter takes a K tile below 16, the compiler does
        # not (`tl.dot` needs K >= 16; one config serves both modes).
        for name in ("split_k", "block_k", "block_n", "n_per_prog", "shrink_warps", "expand_warps", "num_stages"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("block_k", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        for name in ("shrink_warps", "expand_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.split_k < 1 or self.n_per_prog < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, n_per_prog and num_stages must be >= 1: {self}")
        if self.expand_maxnreg is not None and (type(self.expand_maxnreg) is not int
                                                or not 32 <= self.expand_maxnreg <= 255):
            raise ValueError(f"expand_maxnreg must be None or an int in [32, 255], got {self.expand_maxnreg!r}")
        if self.expand_rows and self.n_per_prog != self.block_n:
            raise ValueError(f"a row-at-a-time expand takes one B tile a program: n_per_prog == block_n, got {self}")
        if self.expand_rows and self.expand_ahead:
            raise ValueError(f"expand_ahead is a mode of the tl.dot expand, not of the row-at-a-time one: {self}")
        if self.split_sum not in SPLIT_SUMS:
            raise ValueError(f"split_sum must be one of {SPLIT_SUMS}, got {self.split_sum!r}")


def pick_config(
    num_chunks: int, n_slices: int, in_features: int, chunk_size: int, one_pair: bool = False
) -> LoraKernelConfig:
    """Aim the shrink at ~512 programs: split K finely when few chunks are active (decode with few
    adapters), little when many are; likewise give each expand program fewer columns when few
    chunks are active. Tuned on the H200 with `bench/kernels.py --sweep`. (Many columns a program
    when many chunks meet gate/up's wide slices, 2048, was faster alone in the sweep, 38.8 -> 34.6 µs
    at 64 tokens on 64 adapters, and slower in the engine, where the expand runs beside the GEMM on
    the SMs it leaves free: 64 adapters 8,175 -> 7,830 tok/s. Not used.)

    one_pair: the step has one-pair chunks (`LoraMeta.one_pair_chunks`): the shrink then runs a
    multiply-and-sum a row (`shrink_rows`) when SHRINK_ROWS is set, and the expand likewise
    (`expand_rows`, one B tile of EXPAND_ROWS[0] columns a program, EXPAND_ROWS[1] warps, at most
    EXPAND_ROWS[2] registers a thread where given) when EXPAND_ROWS is."""
    many = num_chunks > SHRINK_FEW_CHUNKS
    block_k = SHRINK_BLOCK_K[many] if chunk_size <= 16 else 64
    decode_rows = one_pair and chunk_size <= 16  # where either launch may run a row at a time
    rows = bool(SHRINK_ROWS) and decode_rows
    shrink_warps = SHRINK_WARPS[many]
    if rows:
        block_k, shrink_warps = SHRINK_ROWS
    by_chunks = triton.next_power_of_2(max(1, -(-512 // max(1, num_chunks * n_slices))))
    split_k = max(1, min(-(-in_features // 512), by_chunks))
    wide = num_chunks * n_slices >= WIDE_EXPAND[0]
    n_per_prog = 128 if num_chunks <= 4 else WIDE_EXPAND[1] if wide else 256
    block_n = 128 if chunk_size <= 16 else 64
    expand_warps = 4
    expand_rows = bool(EXPAND_ROWS) and decode_rows
    maxnreg = None
    if expand_rows:
        block_n = n_per_prog = EXPAND_ROWS[0]
        expand_warps = EXPAND_ROWS[1]
        maxnreg = EXPAND_ROWS[2] if len(EXPAND_ROWS) > 2 else None
    return LoraKernelConfig(
        split_k=split_k, block_k=block_k, block_n=block_n, n_per_prog=max(n_per_prog, block_n),
        shrink_warps=shrink_warps, expand_warps=expand_warps, num_stages=NUM_STAGES[many], shrink_rows=rows,
        expand_rows=expand_rows, expand_maxnreg=maxnreg,
        expand_ahead=_expand_ahead_for(num_chunks, chunk_size, n_per_prog, block_n),
        split_sum=EXPAND_SPLIT_SUM, meta_round=CHUNK_META_ROUND,
    )


def config_for_meta(meta: LoraMeta, n_slices: int, in_features: int) -> LoraKernelConfig:
    """`pick_config` for a step's metadata (its chunks, chunk size and one-pair flag): what
    `plan_lora_triton` launches with when given no config."""
    return pick_config(meta.num_chunks, n_slices, in_features, meta.chunk_size, meta.one_pair_chunks)


def _expand_ahead_for(num_chunks: int, chunk_size: int, n_per_prog: int, block_n: int) -> bool:
    """`pick_config`'s choice of `expand_ahead` for these tiles (EXPAND_AHEAD): chunks of at most 16
    rows, several tiles a program, so never the row expand, whose one tile is its program's
    (`with_expand_tiles` keeps the rule for other tiles)."""
    return EXPAND_AHEAD[num_chunks > SHRINK_FEW_CHUNKS] and chunk_size <= 16 and n_per_prog > block_n


def with_expand_tiles(cfg: LoraKernelConfig, num_chunks: int, chunk_size: int, n_per_prog: int,
                      block_n: int) -> LoraKernelConfig:
    """cfg with the tl.dot expand's tiles changed (n_per_prog columns a program in block_n tiles),
    `expand_ahead` as `pick_config`'s rule sets it for them: for launch-config sweeps."""
    return replace(cfg, n_per_prog=n_per_prog, block_n=block_n, expand_rows=False,
                   expand_ahead=_expand_ahead_for(num_chunks, chunk_size, n_per_prog, block_n))


# pick_config's knobs, module-level so bench/overlap_sweep.py can compare them in the engine.
# From how many (chunk, slice) pairs the expand gives each program WIDE_EXPAND[1] columns, and
# the shrink's warps a program with at most and above SHRINK_FEW_CHUNKS chunks. Measured on the
# H200 (docs/benchmarks-history.md, seventh session): alone, 2 warps made every shrink 5-8% faster and, at
# 64 chunks, 512 columns made qkv's expand 11% faster; in the engine at batch 64 with 64 adapters
# each took 0.739 to 0.751-0.753 and both together to 0.754-0.758, while 2 warps with 8 adapters
# (16 chunks) went 0.926-0.929 to 0.924-0.925, so they keep 4. (The sixth session's: 256 pairs, 4 warps.)
WIDE_EXPAND = (128, 512)
SHRINK_WARPS = (4, 2)
# The shrink's K tile for chunks of at most 16 rows (wider chunks take 64) and both launches'
# pipeline stages, with at most and above SHRINK_FEW_CHUNKS chunks. K tiles of 512 and 1024 (2
# stages) above 16 chunks were no faster alone and slower in the engine (docs/benchmarks-history.md).
# With few chunks 256 rather than 128 (nineteenth session): alone 5-7% faster at 16 tokens on one
# adapter; in the engine at batch 64, six paired passes, 8 adapters 0.927-0.928 -> 0.930-0.935 of
# base-only, 1 adapter 0.953-0.956 -> 0.952-0.955.
SHRINK_BLOCK_K = (256, 128)
NUM_STAGES = (3, 3)
SHRINK_FEW_CHUNKS = 16
# The shrink a row at a time for a step of one-pair chunks (`LoraMeta.one_pair_chunks`): (K tile,
# warps); () = never. Alone (64 tokens on 64 adapters, shrink-gemv-h200.json) within
# ±0.8 µs of the tl.dot shrink; in the engine at batch 64 with 64 adapters 0.754/0.755 ->
# 0.764/0.762 of base-only with K tile 256 (512: 0.756/0.755; 256 with 2 warps: 0.755), 8
# adapters unchanged (docs/benchmarks-history.md, eighth session).
SHRINK_ROWS: tuple[int, int] | tuple[()] = (256, 4)
# The expand a row at a time for a step of one-pair chunks: (columns a program, warps[, ptxas'
# register cap]); () = never. Alone (64 tokens on 64 adapters, the storing expand,
# lora-parts-expand-rows2-h200.json) 7-14% faster than the tl.dot expand and the pair 5-22% faster
# (qkv 17.16 -> 14.61 µs, o 11.16 -> 8.73); in the engine at batch 64 with 64 adapters
# 0.771/0.769 -> 0.780/0.780 of base-only (256 columns, 1 warp: 0.780/0.779; 1024, 4: 0.781/0.784);
# 8 adapters (16 chunks) never take it (docs/benchmarks-history.md, thirteenth session). At rank 16 it holds
# 204 registers a thread; capped at 168 the pair ran 3-8% faster at 64 tokens on 64 adapters and
# 7-17% on 48 (144 and 192 were slower than 160-176), and in the engine 0.775/0.777 -> 0.779/0.778
# (fourteenth session).
EXPAND_ROWS: tuple[int, int] | tuple[int, int, int] | tuple[()] = (512, 2, 168)
# The tl.dot expand's next tile (B, and y when adding into it) loaded before this tile is multiplied
# and written (`expand_ahead`), in programs of several tiles of chunks of at most 16 rows, with at
# most and above SHRINK_FEW_CHUNKS chunks. Alone on the H200 (twentieth session, bench/expand_ahead.py,
# expand-ahead-h200.json): with few chunks the rows of several tiles a program 3-18% faster (8
# adapters at 16-64 tokens 0.82-0.96x, 1 or 8 adapters at 256 tokens 0.91-0.97x), except gate/up
# with out-major B (1.03x) and the k = 2 rows (0.97-1.02x); with many chunks (64-128 adapters at 256
# tokens) 0.95-1.14x, so off. Chunks of 64 rows (1,024 tokens on 1 or 8 adapters,
# expand-ahead-prefill-h200.json): 0.96-0.97x, but gate/up, the longest, 1.05x, so off. In the
# engine at batch 64 (the side path's storing expand: B only) 8 adapters 0.933 -> 0.932. Issuing the
# second tile's loads before the wait for the shrink, and peeling the last tile off the loop, both
# lost (docs/benchmarks-history.md, twentieth session).
EXPAND_AHEAD = (True, False)


# How the expand sums the shrink's K-split partials after its wait (`LoraKernelConfig.split_sum`,
# lora_kernels._sum_splits): "loop", a split a loop iteration (ptxas unrolls it by 4 and issues each
# group's loads after the previous group's adds: down_proj's 28 splits are 7 rounds of L2 latency);
# "unroll", the splits in straight-line code, their loads in one round, for launches of at most
# MAX_UNROLLED_SPLITS splits whose partial reads (`partial_read_bytes`) stay within
# UNROLL_MAX_PARTIAL_BYTES (the loop above). Alone on the H200 (twenty-first session, `python -m
# bench.knob_ab --knob EXPAND_SPLIT_SUM`, split-sum-h200.json): down 0.87-0.93x at 16-256 tokens on
# 1-8 adapters, the other rows 0.93-1.00x, except gate/up at 256 tokens on 1 and 8 adapters (1.10x,
# 1.02x: 15 MB of partials read at once), which the bytes bound keeps on the loop
# (split-sum-rule-h200.json); one [splits, ...] block load a round instead was slower in most rows
# (0.97-1.38x). In the engine at batch 64 within the noise (overlap-sweep-split-sum-h200.json: 64
# adapters 0.774-0.777 -> 0.778-0.779, 8 adapters 0.929-0.930 -> 0.928-0.931). Its cost: each
# unrolled split count is a compiled variant of the expand of its own (at the seed shape 2, 4 or 8
# splits for qkv, o and gate/up, up to 16 and 28 for down), which Triton compiles on first use
# where the loop needed one; the engine's warm-up covers the few its two prompts meet, and its
# LoRA decode graphs, captured on first use, compile theirs then.
SPLIT_SUMS = ("loop", "unroll")
EXPAND_SPLIT_SUM = "unroll"
MAX_UNROLLED_SPLITS = 32
UNROLL_MAX_PARTIAL_BYTES = 12 << 20


def partial_read_bytes(num_chunks: int, column_groups: int, split_k: int, rows: int, r_pad: int) -> int:
    """About what an expand launch reads of the shrink's partials: every program (a chunk's column
    group) reads `rows` rows of r_pad fp32 partials from each split (launch_expand passes the chunk
    size, an upper bound, or 1 for the row-at-a-time expand, whose one-pair steps have a few chunks
    of 2)."""
    return num_chunks * column_groups * split_k * rows * r_pad * 4


def split_sum_code(split_sum: str, split_k: int, partial_bytes: int = 0) -> int:
    """The expand's SPLIT_SUM constexpr (see _sum_splits): 0 for the loop, else the split count."""
    unrolled = split_sum == "unroll" and split_k <= MAX_UNROLLED_SPLITS and partial_bytes <= UNROLL_MAX_PARTIAL_BYTES
    return split_k if unrolled and split_k > 1 else 0


# Both kernels' first loads, a chunk's slot, start and end, in one round (`meta_round`): compiled for
# sm_90 the compiler sinks the start and end loads below the padding chunk's early exit, which needs
# only the slot, so they go out after the slot has come back: four dependent rounds of loads before
# the shrink's data (slot; start, end and rank; tokens; x and A), three with the exit on all three.
# Alone on the H200 (twenty-first session, `python -m bench.knob_ab --knob CHUNK_META_ROUND`,
# meta-round-h200.json, meta-round-64-h200.json): 64 tokens on 64 adapters qkv 0.96x, gate/up 0.98x,
# o and down 0.99-1.00x; the few-adapter rows 0.99-1.03x (qkv at 16 tokens on 1 adapter the 1.03x).
# In the engine (twenty-second session, `python -m bench.overlap_sweep --variants 62,63 --adapters 0,1,8,64
# --repeats 3 --new-tokens 128`, overlap-sweep-meta-round-h200.json), on against off in each of three
# passes: 64 adapters 0.783/0.781/0.779 vs 0.783/0.777/0.777 of base-only, 8 adapters 0.940/0.936/0.937
# vs 0.938/0.932/0.935: never behind, by noise-sized margins. On.
CHUNK_META_ROUND = True

"""The LoRA kernels' launch parameters: `LoraKernelConfig`, and `pick_config`'s choice of them for a
step (its chunks, chunk size, slices and K) from a `LoraTuning` (lorafleet.kernels.lora.tuning: the
tuned values as data, one file a device). `lorafleet.kernels.lora.launch` plans and launches with a
config. Why each tuned value is what it is: docs/benchmarks.md, "LoRA kernel tuning".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.lora.tuning import SPLIT_SUMS, LoraTuning, active_tuning


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
    shrink_rows: bool = False  # the shrink's multiply-and-sum a row (programs, ROWS) instead of tl.dot
    expand_rows: bool = False  # the expand's likewise, one B tile a program (n_per_prog == block_n)
    expand_maxnreg: int | None = None  # registers a thread the expand may hold (ptxas' cap); None = its choice
    expand_ahead: bool = False  # the tl.dot expand loads each next tile before writing this one (programs, AHEAD)
    split_sum: str = "unroll"  # how the expand sums the K splits' partials: "loop" or "unroll" (split_sum_code)
    meta_round: bool = False  # both kernels load a chunk's slot, start and end in one round (programs, META_ROUND)

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
    num_chunks: int, n_slices: int, in_features: int, chunk_size: int, one_pair: bool = False,
    tuning: LoraTuning | None = None,
) -> LoraKernelConfig:
    """Aim the shrink at ~512 programs: split K finely when few chunks are active (decode with few
    adapters), little when many are; likewise give each expand program fewer columns when few
    chunks are active. The rest comes from `tuning` (default: the process's, `active_tuning`).

    one_pair: the step has one-pair chunks (`LoraMeta.one_pair_chunks`): the shrink then runs a
    multiply-and-sum a row (`shrink_rows`) when tuning.shrink_rows is set, and the expand likewise
    (`expand_rows`, one B tile of expand_rows[0] columns a program, expand_rows[1] warps, at most
    expand_rows[2] registers a thread where given) when tuning.expand_rows is."""
    t = active_tuning() if tuning is None else tuning
    many = num_chunks > t.few_chunks
    block_k = t.shrink_block_k[many] if chunk_size <= 16 else 64
    decode_rows = one_pair and chunk_size <= 16  # where either launch may run a row at a time
    rows = bool(t.shrink_rows) and decode_rows
    shrink_warps = t.shrink_warps[many]
    if rows:
        block_k, shrink_warps = t.shrink_rows
    by_chunks = triton.next_power_of_2(max(1, -(-512 // max(1, num_chunks * n_slices))))
    split_k = max(1, min(-(-in_features // 512), by_chunks))
    wide = num_chunks * n_slices >= t.wide_expand[0]
    n_per_prog = 128 if num_chunks <= 4 else t.wide_expand[1] if wide else 256
    block_n = 128 if chunk_size <= 16 else 64
    expand_warps = 4
    expand_rows = bool(t.expand_rows) and decode_rows
    maxnreg = None
    if expand_rows:
        block_n = n_per_prog = t.expand_rows[0]
        expand_warps = t.expand_rows[1]
        maxnreg = t.expand_rows[2] if len(t.expand_rows) > 2 else None
    return LoraKernelConfig(
        split_k=split_k, block_k=block_k, block_n=block_n, n_per_prog=max(n_per_prog, block_n),
        shrink_warps=shrink_warps, expand_warps=expand_warps, num_stages=t.num_stages[many], shrink_rows=rows,
        expand_rows=expand_rows, expand_maxnreg=maxnreg,
        expand_ahead=_expand_ahead_for(num_chunks, chunk_size, n_per_prog, block_n, t),
        split_sum=t.split_sum, meta_round=t.meta_round,
    )


def config_for_meta(meta: LoraMeta, n_slices: int, in_features: int,
                    tuning: LoraTuning | None = None) -> LoraKernelConfig:
    """`pick_config` for a step's metadata (its chunks, chunk size and one-pair flag): what
    `plan_lora_triton` launches with when given no config."""
    t = active_tuning() if tuning is None else tuning
    return pick_config(meta.num_chunks, n_slices, in_features, meta.chunk_size, meta.one_pair_chunks_for(t), t)


def _expand_ahead_for(num_chunks: int, chunk_size: int, n_per_prog: int, block_n: int, tuning: LoraTuning) -> bool:
    """`pick_config`'s choice of `expand_ahead` for these tiles (tuning.expand_ahead): chunks of at
    most 16 rows, several tiles a program, so never the row expand, whose one tile is its program's
    (`with_expand_tiles` keeps the rule for other tiles)."""
    return tuning.expand_ahead[num_chunks > tuning.few_chunks] and chunk_size <= 16 and n_per_prog > block_n


def with_expand_tiles(cfg: LoraKernelConfig, num_chunks: int, chunk_size: int, n_per_prog: int,
                      block_n: int, tuning: LoraTuning | None = None) -> LoraKernelConfig:
    """cfg with the tl.dot expand's tiles changed (n_per_prog columns a program in block_n tiles),
    `expand_ahead` as `pick_config`'s rule sets it for them: for launch-config sweeps."""
    t = active_tuning() if tuning is None else tuning
    return replace(cfg, n_per_prog=n_per_prog, block_n=block_n, expand_rows=False,
                   expand_ahead=_expand_ahead_for(num_chunks, chunk_size, n_per_prog, block_n, t))


# The expand sums the shrink's K-split partials after its wait (`LoraKernelConfig.split_sum`,
# programs._sum_splits) either a split a loop iteration ("loop": ptxas unrolls it by 4 and issues each
# group's loads after the previous group's adds) or in straight-line code, every split's loads in one
# round ("unroll"), for launches of at most tuning.max_unrolled_splits splits whose partial reads
# (`partial_read_bytes`) stay within tuning.unroll_max_partial_bytes (the loop above: reading that many
# bytes at once is slower). Each unrolled split count is a compiled variant of the expand of its own,
# which Triton compiles on first use; the engine's warm-up covers the few its two prompts meet, and
# its LoRA decode graphs, captured on first use, compile theirs then.


def partial_read_bytes(num_chunks: int, column_groups: int, split_k: int, rows: int, r_pad: int) -> int:
    """About what an expand launch reads of the shrink's partials: every program (a chunk's column
    group) reads `rows` rows of r_pad fp32 partials from each split (launch_expand passes the chunk
    size, an upper bound, or 1 for the row-at-a-time expand, whose one-pair steps have a few chunks
    of 2)."""
    return num_chunks * column_groups * split_k * rows * r_pad * 4


def split_sum_code(split_sum: str, split_k: int, partial_bytes: int = 0, tuning: LoraTuning | None = None) -> int:
    """The expand's SPLIT_SUM constexpr (see _sum_splits): 0 for the loop, else the split count."""
    t = active_tuning() if tuning is None else tuning
    unrolled = split_sum == "unroll" and split_k <= t.max_unrolled_splits and partial_bytes <= t.unroll_max_partial_bytes
    return split_k if unrolled and split_k > 1 else 0

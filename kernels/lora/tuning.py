"""The LoRA kernels' tuned launch choices as data: `LoraTuning`, one JSON file a device under
`tunings/`, chosen by the device's name, overridden by LORAFLEET_LORA_TUNING.

`pick_config` (lorafleet.kernels.lora.config) and `LoraMeta.one_pair_chunks` read these values; they
take a tuning as an argument, the loaded one (`active_tuning`) by default. The measurements behind
each value are in docs/benchmarks.md, "LoRA kernel tuning". No torch here: the file is pure data.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from lorafleet.kernels import tuning_files

TUNINGS_DIR = Path(__file__).with_name("tunings")
SPLIT_SUMS = ("loop", "unroll")


@dataclass(frozen=True, slots=True)
class LoraTuning:
    """What `pick_config` chooses from; every field comes from a tuning file. Pairs are (at most,
    above) `few_chunks` chunks."""

    few_chunks: int  # a launch of more chunks takes the "many" half of each pair
    wide_expand: tuple[int, int]  # from this many (chunk, slice) pairs, this many expand columns a program
    shrink_warps: tuple[int, int]
    shrink_block_k: tuple[int, int]  # the shrink's K tile for chunks of at most 16 rows (wider: 64)
    num_stages: tuple[int, int]
    shrink_rows: tuple[int, ...]  # one-pair steps: the row shrink's (K tile, warps); () = never
    expand_rows: tuple[int, ...]  # one-pair steps: (columns, warps[, register cap]); () = never
    expand_ahead: tuple[bool, bool]  # the tl.dot expand loads its next tile ahead
    split_sum: str  # how the expand sums the K splits: "loop" or "unroll"
    max_unrolled_splits: int
    unroll_max_partial_bytes: int
    meta_round: bool  # a chunk's slot, start and end loaded in one round
    one_pair_chunks: tuple[float, int]  # at most this many pairs a chunk on average, none over
    one_pair_min_chunks: int  # ... in a step of more than this many chunks

    def __post_init__(self) -> None:
        for name in ("wide_expand", "shrink_warps", "shrink_block_k", "num_stages", "expand_ahead", "one_pair_chunks"):
            if len(getattr(self, name)) != 2:
                raise ValueError(f"{name} must be a pair, got {getattr(self, name)!r}")
        if len(self.shrink_rows) not in (0, 2):
            raise ValueError(f"shrink_rows must be () or (K tile, warps), got {self.shrink_rows!r}")
        if len(self.expand_rows) not in (0, 2, 3):
            raise ValueError(f"expand_rows must be () or (columns, warps[, registers]), got {self.expand_rows!r}")
        if self.split_sum not in SPLIT_SUMS:
            raise ValueError(f"split_sum must be one of {SPLIT_SUMS}, got {self.split_sum!r}")
        if self.few_chunks < 0 or self.one_pair_min_chunks < 0 or self.max_unrolled_splits < 1:
            raise ValueError(f"few_chunks, one_pair_min_chunks >= 0 and max_unrolled_splits >= 1: {self}")


def tuning_from_dict(data: dict[str, Any], base: LoraTuning | None = None) -> LoraTuning:
    """A tuning from JSON-shaped data: lists become tuples; fields not given keep `base`'s (without a
    base every field must be given). Unknown or missing fields are an error naming them."""
    known = {f.name for f in fields(LoraTuning)}
    unknown = sorted(set(data) - known - {"device", "comment"})
    if unknown:
        raise ValueError(f"unknown LoRA tuning fields {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
    if base is not None:
        return replace(base, **values)
    missing = sorted(known - set(values))
    if missing:
        raise ValueError(f"LoRA tuning fields missing: {missing}")
    return LoraTuning(**values)


def tuning_to_dict(tuning: LoraTuning) -> dict[str, Any]:
    """The JSON-shaped form of a tuning (tuples as lists): what `tuning_from_dict` reads back."""
    return {f.name: list(v) if isinstance(v := getattr(tuning, f.name), tuple) else v for f in fields(tuning)}


def device_file(device_name: str, tunings_dir: Path = TUNINGS_DIR) -> Path:
    """The tuning file for a device (`kernels/tuning_files.device_file`)."""
    return tuning_files.device_file(device_name, tunings_dir)


def load_tuning(device_name: str = "", override: str = "", tunings_dir: Path = TUNINGS_DIR) -> LoraTuning:
    """The device's tuning (`device_file`), with `override` applied over it: a path to a JSON file or
    inline JSON (an object of the fields to change), as LORAFLEET_LORA_TUNING takes."""
    tuning = tuning_from_dict(tuning_files.read_object(device_file(device_name, tunings_dir)))
    data = tuning_files.read_override(override, "LORAFLEET_LORA_TUNING")
    return tuning if data is None else tuning_from_dict(data, tuning)


def tuning_env(tuning: LoraTuning) -> dict[str, str]:
    """The environment that makes a new process load exactly `tuning` (for in-engine A/B runs)."""
    return {"LORAFLEET_LORA_TUNING": json.dumps(tuning_to_dict(tuning))}


@functools.cache
def active_tuning() -> LoraTuning:
    """The process's tuning: loaded once, on first use, for the current CUDA device (default.json on
    the CPU and under the interpreter), with LORAFLEET_LORA_TUNING over it."""
    from lorafleet.kernels import envs

    return load_tuning(tuning_files.current_device_name(envs.interpreting()), envs.LORA_TUNING)

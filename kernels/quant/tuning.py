"""The W8A16 GEMM's launch choices as data: `Fp8Tuning`, one JSON file a device under `tunings/`,
chosen by the device's name (as the LoRA kernels' `kernels/lora/tuning.py`), overridden by
LORAFLEET_FP8_TUNING (a path or inline JSON of the fields to change).

A file holds `decode`: launch configs by the step's rows (the first whose `max_m` covers M), `shapes`:
the same lists for one weight shape (`"NxK"`, checked first; what `bench/fp8_tune.py` writes), and
`prefill`: what runs above `prefill_min_m` rows: "triton" (the same kernel, `prefill_config`),
"dequant" (the weight cast to bf16, a cuBLAS GEMM, the scales applied to its output) or "scaled_mm"
(`torch._scaled_mm` with row-wise dynamic FP8 activations: faster on Hopper, activations rounded to
FP8 too). No torch here: the file is pure data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.kernels import tuning_files

TUNINGS_DIR = Path(__file__).with_name("tunings")
PREFILL_PATHS = ("triton", "dequant", "scaled_mm")


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """One launch of the W8A16 kernel: tiles, K split (partial sums added atomically in fp32), warps,
    stages, and `swap_ab`: the product taken as (W x^T)^T, the weight tile the MMA's left operand (its
    rows the MMA's M, converted in registers) and the few activation rows its N."""

    max_m: int
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    swap_ab: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {v}")
        if self.split_k < 1 or self.warps not in (1, 2, 4, 8, 16) or self.stages < 1 or self.max_m < 1:
            raise ValueError(f"split_k >= 1, warps a power of two <= 16, stages >= 1, max_m >= 1: {self}")


@dataclass(frozen=True, slots=True)
class Fp8Tuning:
    decode: tuple[LaunchConfig, ...]
    shapes: dict[str, tuple[LaunchConfig, ...]]
    prefill: str
    prefill_min_m: int
    prefill_config: LaunchConfig

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_PATHS:
            raise ValueError(f"prefill must be one of {PREFILL_PATHS}, got {self.prefill!r}")
        if not self.decode:
            raise ValueError("decode needs at least one launch config")

    def pick(self, m: int, n: int, k: int) -> LaunchConfig:
        """The launch config for an `[m, k] x [n, k]^T` product (m at most prefill_min_m, or any m on
        the triton prefill path)."""
        if m > self.prefill_min_m:
            return self.prefill_config
        for table in (self.shapes.get(f"{n}x{k}", ()), self.decode):
            for c in table:
                if m <= c.max_m:
                    return c
        return self.decode[-1]


def _configs(rows: list[dict[str, Any]]) -> tuple[LaunchConfig, ...]:
    return tuple(sorted((LaunchConfig(**r) for r in rows), key=lambda c: c.max_m))


def tuning_from_dict(data: dict[str, Any]) -> Fp8Tuning:
    known = {"decode", "shapes", "prefill", "prefill_min_m", "prefill_config", "device", "comment"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown FP8 tuning fields {unknown}; known: {sorted(known)}")
    return Fp8Tuning(decode=_configs(data["decode"]),
                     shapes={s: _configs(rows) for s, rows in data.get("shapes", {}).items()},
                     prefill=data["prefill"], prefill_min_m=int(data["prefill_min_m"]),
                     prefill_config=LaunchConfig(**data["prefill_config"]))


def load_tuning(device_name: str = "", override: str = "", tunings_dir: Path = TUNINGS_DIR) -> Fp8Tuning:
    data = tuning_files.read_object(tuning_files.device_file(device_name, tunings_dir))
    return tuning_from_dict({**data, **(tuning_files.read_override(override, "LORAFLEET_FP8_TUNING") or {})})


@functools.cache
def active_tuning() -> Fp8Tuning:
    """The process's tuning, loaded once for the current CUDA device (default.json on the CPU)."""
    from lorafleet.kernels import envs

    return load_tuning(tuning_files.current_device_name(envs.interpreting()), envs.FP8_TUNING)

"""Every environment variable the kernels read, in one place, read once at import (start-up).

| variable | default | meaning |
|---|---|---|
| `TRITON_INTERPRET` | `0` | `1`: Triton kernels run in Triton's interpreter on the CPU (tests); read on each call, as Triton does |
| `LORAFLEET_PDL` | `1` | `0`: never launch with programmatic dependent launch (Hopper), for A/B runs |
| `LORAFLEET_OVERLAP_MAX_CHUNKS` | unlimited | the LoRA side path runs beside the base GEMM only for steps of at most this many chunks |
| `LORAFLEET_GEMM_SM_CARVEOUT` | `48,80,48,48` | SMs left to the LoRA kernels beside the GEMM: `N`, `few,many` or `few-small,many-small,few-large,many-large` |
| `LORAFLEET_LORA_FEW_CHUNKS` | `16` | the side path's "few chunks" bound: above it, the `many` half of the pairs below applies |
| `LORAFLEET_GEMM_FIRST` | `1,1` | the base GEMM launched before the LoRA kernels beside it, with few, many chunks (`0`/`1` each) |
| `LORAFLEET_DELTA_STORE` | `1,1` | with one adapter per token the expand stores the delta (nothing zeroes it), with few, many chunks |
| `LORAFLEET_ZERO_IN_SHRINK` | `1` | `0`: a memset zeroes the delta above the few-chunks bound instead of the shrink's programs |
| `LORAFLEET_LORA_TUNING` | the device's file | the LoRA kernels' tuning (`kernels/lora/tunings/*.json`) overridden: a path to a JSON file or inline JSON of the fields to change |
| `LORAFLEET_FP8_TUNING` | the device's file | the FP8 GEMM's tuning (`kernels/quant/tunings/*.json`) overridden: a path to a JSON file or inline JSON of the fields to change |
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


PDL = os.environ.get("LORAFLEET_PDL", "1") != "0"
OVERLAP_MAX_CHUNKS = int(os.environ.get("LORAFLEET_OVERLAP_MAX_CHUNKS", str(1 << 30)))
GEMM_SM_CARVEOUT = os.environ.get("LORAFLEET_GEMM_SM_CARVEOUT", "48,80,48,48")
LORA_FEW_CHUNKS = int(os.environ.get("LORAFLEET_LORA_FEW_CHUNKS", "16"))
GEMM_FIRST = os.environ.get("LORAFLEET_GEMM_FIRST", "1,1")
DELTA_STORE = os.environ.get("LORAFLEET_DELTA_STORE", "1,1")
ZERO_IN_SHRINK = os.environ.get("LORAFLEET_ZERO_IN_SHRINK", "1") != "0"
LORA_TUNING = os.environ.get("LORAFLEET_LORA_TUNING", "")
FP8_TUNING = os.environ.get("LORAFLEET_FP8_TUNING", "")

"""Every environment variable the kernels read, in one place, read once at import (start-up).

| variable | default | meaning |
|---|---|---|
| `TRITON_INTERPRET` | `0` | `1`: Triton kernels run in Triton's interpreter on the CPU (tests); read on each call, as Triton does |
| `LORAFLEET_PDL` | `1` | `0`: never launch with programmatic dependent launch (Hopper), for A/B runs |
| `LORAFLEET_OVERLAP_MAX_CHUNKS` | unlimited | the LoRA side path runs beside the base GEMM only for steps of at most this many chunks |
| `LORAFLEET_GEMM_SM_CARVEOUT` | `48,80,48,48` | SMs left to the LoRA kernels beside the GEMM: `N`, `few,many` or `few-small,many-small,few-large,many-large` |
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


PDL = os.environ.get("LORAFLEET_PDL", "1") != "0"
OVERLAP_MAX_CHUNKS = int(os.environ.get("LORAFLEET_OVERLAP_MAX_CHUNKS", str(1 << 30)))
GEMM_SM_CARVEOUT = os.environ.get("LORAFLEET_GEMM_SM_CARVEOUT", "48,80,48,48")

"""What the decoder's fused row kernels (`rms_norm`, `rope_kv`, `silu_mul`) share: the LoRA delta
they may add, the dtypes they take and their warp count.

Why fuse: a decode step is launch-bound. At batch 64 on the seed shape a step replayed from a CUDA
graph launches ~1,550 kernels, most of them tiny elementwise torch ops at ~2 µs each even in a
graph. Counted per layer in bf16 (aten ops under a dispatch mode), the torch path launches 32
besides the 4 matmuls and attention; with the fused ops a layer takes 4: `rope_write_kv`,
`silu_mul` and two `add_rms_norm`, plus one plain `rms_norm` per step. Each op computes in fp32
and rounds to the activation dtype wherever the torch path of `worker/models/llama.py` rounds; its
`*_reference` is the oracle.

`delta` is the LoRA side path's output when it ran beside the base GEMM on another stream
(`lora_linear.linear_lora_deferred`): adding it here, where the row is read anyway, saves the
LoRA expand's read-modify-write of the projection's output on the main stream. `delta_rows`
(`[T]` int, optional; `LoraMeta.has_lora`) names the rows whose delta is defined: elsewhere it
counts as 0 whatever it holds (a storing expand leaves those rows unwritten, nothing zeroes them).

Every launch's grid and arguments follow from tensor shapes only and nothing syncs with the host
(positions and slots are read on the device), so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def row_warps(block: int) -> int:
    """About 16 elements per thread, 4 to 16 warps."""
    return min(16, max(4, block // 512))


@triton.jit
def delta_defined(rows_ptr, row, HAS_ROWS: tl.constexpr):
    """Whether this row's delta is defined: rows[row] != 0 with HAS_ROWS, else always."""
    if HAS_ROWS:
        return tl.load(rows_ptr + row) != 0
    return row >= 0


@triton.jit
def load_plus(src, delta, mask, use_delta, HAS_DELTA: tl.constexpr):
    """src (+ delta if use_delta, the sum rounded to src's dtype) as fp32. The delta is loaded
    either way (under the same mask as src, so the loads stay vectors) and dropped where unused:
    it may hold anything there, NaN included."""
    x = tl.load(src, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.where(use_delta, tl.load(delta, mask=mask, other=0.0).to(tl.float32), 0.0)
        x = (x.to(tl.float32) + d).to(x.dtype)
    return x.to(tl.float32)


def check_delta(
    delta: torch.Tensor | None, like: torch.Tensor, name: str, rows: torch.Tensor | None = None
) -> torch.Tensor | None:
    """-> the rows the kernel masks the delta with: None without a delta or without rows."""
    if delta is not None and (delta.shape != like.shape or delta.dtype != like.dtype or delta.stride(-1) != 1
                              or delta.device != like.device):
        raise ValueError(f"delta must be {tuple(like.shape)} {like.dtype} like {name}, with unit stride in "
                         f"features; got {tuple(delta.shape)} {delta.dtype}")
    if rows is None or delta is None:
        return None
    if rows.shape != (like.shape[0],) or rows.is_floating_point() or rows.stride(0) != 1 or rows.device != like.device:
        raise ValueError(f"delta_rows must be a contiguous [{like.shape[0]}] integer tensor on {like.device}, got "
                         f"{tuple(rows.shape)} {rows.dtype} on {rows.device}")
    return rows


def masked_delta(delta: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The references' delta: 0 on rows that `rows` leaves out (whatever they hold, NaN included)."""
    if delta is None or rows is None:
        return delta
    return torch.where(rows.to(delta.device).unsqueeze(1) != 0, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))

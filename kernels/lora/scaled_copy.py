"""Many small strided copies in one launch, each scaled and cast on the way (`scaled_copies`).

A freshly read adapter is laid out for the GPU slots on the GPU (`worker/lora/packing.py`,
`PackPlan.run`): at the seed shape that is 448 tensors (every layer's A as it is, B transposed
and times alpha/r, all cast to the slot dtype). One torch copy each costs ~5 µs of host time a
launch, milliseconds a load after the last byte has arrived; this is one launch per source dtype.

Semantics (`scaled_copies_reference` is the oracle). For each row k of `table`, the copy
(src offset, dst offset, rows, cols, row stride, col stride) in elements of `src` and `dst`:

    for i < rows, j < cols:
        dst[dst_off + i*cols + j] = (float32(src[src_off + i*row_stride + j*col_stride]) * scales[k]).to(dst.dtype)

One rounding, to nearest even, from float32: what torch's `(b.float() * s).to(dtype)`, a
`copy_` that converts, and a bf16/fp16 `mul` (float32 opmath) each give.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TABLE_COLUMNS = 6  # src offset, dst offset, rows, cols, row stride, col stride
BLOCK = 2048  # elements of one copy a program moves at a time
MAX_BLOCKS = 4096  # programs per copy (each strides over the copy's blocks past that)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _to_bf16_bits(y):
    """float32 -> bfloat16 bits (int16), rounded to nearest even, NaN as 0x7FC0 (as torch rounds).
    Spelled out because the Triton interpreter's own cast truncates; compiled, it is what
    `cvt.rn.bf16.f32` gives."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = tl.where(y != y, 0x7FC0, rounded)
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _scaled_copies_kernel(src_ptr, dst_ptr, table_ptr, scales_ptr, BLOCK: tl.constexpr, BF16_BITS: tl.constexpr):
    k = tl.program_id(0)
    row = table_ptr + k * 6
    src_off = tl.load(row)
    dst_off = tl.load(row + 1)
    cols = tl.load(row + 3)
    n = tl.load(row + 2) * cols
    row_stride = tl.load(row + 4)
    col_stride = tl.load(row + 5)
    scale = tl.load(scales_ptr + k)
    # Programs along axis 1 stride over the copy's blocks (the grid's axis 1 stops at 65,535).
    for start in range(tl.program_id(1).to(tl.int64) * BLOCK, n, tl.num_programs(1).to(tl.int64) * BLOCK):
        idx = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = idx < n
        i = idx // cols
        j = idx - i * cols
        x = tl.load(src_ptr + src_off + i * row_stride + j * col_stride, mask=mask, other=0.0).to(tl.float32)
        y = x * scale
        if BF16_BITS:  # dst is the bf16 buffer viewed as int16
            tl.store(dst_ptr + dst_off + idx, _to_bf16_bits(y), mask=mask)
        else:
            tl.store(dst_ptr + dst_off + idx, y.to(dst_ptr.dtype.element_ty), mask=mask)


def _check(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, scales: torch.Tensor) -> None:
    if src.dtype not in FLOAT_DTYPES or dst.dtype not in FLOAT_DTYPES:
        raise ValueError(f"scaled_copies takes {FLOAT_DTYPES}, got src {src.dtype}, dst {dst.dtype}")
    if src.dim() != 1 or dst.dim() != 1 or not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError("scaled_copies takes flat contiguous src and dst")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != TABLE_COLUMNS:
        raise ValueError(f"table must be int64 [copies, {TABLE_COLUMNS}], got {table.dtype} {list(table.shape)}")
    if scales.dtype != torch.float32 or scales.shape != (table.shape[0],):
        raise ValueError(f"scales must be float32 [{table.shape[0]}], got {scales.dtype} {list(scales.shape)}")
    if len({t.device for t in (src, dst, table, scales)}) != 1:
        raise ValueError("src, dst, table and scales must be on one device")


def scaled_copies(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, scales: torch.Tensor,
                  max_elements: int) -> None:
    """Every copy `table` names, in one launch (see the module docstring). `max_elements` bounds
    rows * cols over the table (the host knows it; the grid is sized by it, nothing is read back).
    Bounds are the caller's: offsets are not checked against the tensors."""
    _check(src, dst, table, scales)
    if table.shape[0] == 0 or max_elements <= 0:
        return
    grid = (table.shape[0], min(triton.cdiv(max_elements, BLOCK), MAX_BLOCKS))
    bf16 = dst.dtype == torch.bfloat16
    _scaled_copies_kernel[grid](src, dst.view(torch.int16) if bf16 else dst, table, scales, BLOCK=BLOCK,
                                BF16_BITS=bf16, num_warps=4)


def scaled_copies_reference(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor,
                            scales: torch.Tensor) -> None:
    """The oracle: one torch copy per row of `table`."""
    _check(src, dst, table, scales)
    for (src_off, dst_off, rows, cols, row_stride, col_stride), scale in zip(table.tolist(), scales.tolist()):
        view = src.as_strided((rows, cols), (row_stride, col_stride), src_off)
        dst[dst_off : dst_off + rows * cols].view(rows, cols).copy_(view.float() * torch.tensor(scale))

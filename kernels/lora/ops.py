"""The multi-LoRA op for one batch: add the step's LoRA deltas into a projection's output.

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

The step's token -> (slot, scale) mapping is a `LoraMeta` (`lorafleet.kernels.lora.meta`). The torch
reference here is the CPU path and the oracle for the Triton kernels in
`lorafleet.kernels.lora.launch`, which take the same arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.lora.operands import check_shapes


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
    check_shapes(y, x, lora_a, lora_b)
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
        from lorafleet.kernels.lora.launch import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, ranks_device, meta)
    else:
        raise ValueError(f"unknown LoRA backend {backend!r} (torch | triton)")

"""The multi-LoRA op's operands: B stacks in rank-major memory (`new_lora_b`), which layout a B has,
and the shape check the torch reference and the Triton launch share (the layouts are described in
`lorafleet.kernels.lora.ops`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def new_lora_b(
    num_slots: int, out: int, r_max: int, *, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """A zeroed B stack indexed `[S, out, r_max]` with rank-major memory (`[S, r_max, out]` storage).

    A slot's rank-r rows are then one contiguous block of r·out values; write them through the
    view (`b[slot, :, :r].copy_(m.b)`) or the storage (`b.transpose(1, 2)[slot, :r].copy_(m.b.T)`).
    """
    return torch.zeros(num_slots, r_max, out, device=device, dtype=dtype).transpose(1, 2)


def lora_b_layout(b: torch.Tensor) -> str | None:
    """"out_major" (contiguous `[S, out, r_max]`), "rank_major" (`new_lora_b`), or None (other strides)."""
    _, out, r_max = b.shape
    if b.stride(0) != out * r_max:
        return None
    if b.stride(1) == 1 and b.stride(2) == out:
        return "rank_major"
    if b.stride(2) == 1 and b.stride(1) == r_max:
        return "out_major"
    return None


def check_shapes(
    y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]
) -> None:
    """The op's operands fit: as many A as B slices, y `[T, Σ out_s]`, A `[S, r_max, in]`, B `[S, out_s, r_max]`."""
    if len(lora_a) != len(lora_b) or not lora_a:
        raise ValueError("lora_a and lora_b need the same, non-zero number of slices")
    total_out = sum(b.shape[1] for b in lora_b)
    if y.shape != (x.shape[0], total_out):
        raise ValueError(f"y {tuple(y.shape)} must be [T={x.shape[0]}, Σout={total_out}]")
    for a, b in zip(lora_a, lora_b):
        if a.shape[2] != x.shape[1] or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
            raise ValueError(f"slice shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit x {tuple(x.shape)}")

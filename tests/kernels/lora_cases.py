"""Shared helpers for the LoRA kernel tests: slot weights, token mappings, tolerances, and a
runner that applies one step through the torch reference and the Triton kernels.

Without CUDA the kernels run in the Triton interpreter; with CUDA on the GPU.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.lora.config import LoraKernelConfig
from lorafleet.kernels.lora.launch import add_lora_triton
from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.kernels.lora.operands import lora_b_layout, new_lora_b
from lorafleet.kernels.lora.ops import add_lora

LAYOUTS = ["out_major", "rank_major"]

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def make_weights(
    g: torch.Generator,
    slots: int,
    r_max: int,
    d_in: int,
    outs: list[int],
    ranks: list[list[int]],
    dtype,
    device,
    layout: str = "out_major",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stacked slot weights; the padding past each slot's true rank is NaN, so reading it shows.

    layout "rank_major": B in `new_lora_b` memory (the slot pool's), same values.
    """
    lora_a, lora_b = [], []
    for out, slice_ranks in zip(outs, ranks):
        a = torch.randn(slots, r_max, d_in, generator=g) / d_in**0.5
        b = torch.randn(slots, out, r_max, generator=g) / r_max**0.5
        for slot, r in enumerate(slice_ranks):
            a[slot, r:] = float("nan")
            b[slot, :, r:] = float("nan")
        lora_a.append(a.to(device=device, dtype=dtype))
        if layout == "rank_major":
            stored = new_lora_b(slots, out, r_max, device=device, dtype=dtype)
            stored.copy_(b)
            assert lora_b_layout(stored) == "rank_major"
            lora_b.append(stored)
        else:
            lora_b.append(b.to(device=device, dtype=dtype))
    return lora_a, lora_b


def run_both(
    seed: int,
    tokens: int,
    k: int,
    d_in: int,
    outs: list[int],
    ranks: list[list[int]],
    token_slots: torch.Tensor,
    dtype: torch.dtype,
    chunk_size: int | None = None,
    config: LoraKernelConfig | None = None,
    device: str = DEVICE,
    layout: str = "out_major",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y before, y after the reference, y after Triton)."""
    g = torch.Generator().manual_seed(seed)
    slots, r_max = len(ranks[0]), max(1, max(max(r) for r in ranks))
    lora_a, lora_b = make_weights(g, slots, r_max, d_in, outs, ranks, dtype, device, layout)
    scales = torch.rand(tokens, k, generator=g) + 0.25
    meta = build_lora_meta(token_slots.to(torch.int32), scales, slots, device=device, chunk_size=chunk_size)
    x = torch.randn(tokens, d_in, generator=g).to(device=device, dtype=dtype)
    y0 = torch.randn(tokens, sum(outs), generator=g).to(device=device, dtype=dtype)  # poison: y is added to
    y_ref, y_tri = y0.clone(), y0.clone()
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=device)
    add_lora(y_ref, x, lora_a, lora_b, ranks, ranks_dev, meta, backend="torch")
    if config is None:
        add_lora(y_tri, x, lora_a, lora_b, ranks, ranks_dev, meta, backend="triton")
    else:
        add_lora_triton(y_tri, x, lora_a, lora_b, ranks_dev, meta, config=config)
    return y0, y_ref, y_tri


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def mapping(kind: str, g: torch.Generator, tokens: int, k: int, slots: int) -> torch.Tensor:
    if kind == "random_with_none":
        return torch.randint(-1, slots, (tokens, k), generator=g)
    if kind == "one_adapter":
        return (
            torch.full((tokens, k), slots - 1)
            if k == 1
            else torch.randperm(slots, generator=g)[:k].repeat(tokens, 1)
        )
    if kind == "each_token_own":
        return (torch.arange(tokens * k) % slots).reshape(tokens, k)
    if kind == "empty_segments":  # only the odd slots are used
        return 2 * torch.randint(0, slots // 2, (tokens, k), generator=g) + 1
    if kind == "all_none":
        return torch.full((tokens, k), -1)
    raise ValueError(kind)

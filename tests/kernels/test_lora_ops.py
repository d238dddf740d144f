"""The torch reference against a dense loop."""

from __future__ import annotations

import torch

from lorafleet.kernels.lora.meta import LoraMeta, build_lora_meta
from lorafleet.kernels.lora.ops import add_lora_reference


def dense_lora(x, token_slots, token_scales, lora_a, lora_b, ranks) -> torch.Tensor:
    """Per-token, per-entry loop in float64: the textbook formula."""
    rows = []
    for t in range(x.shape[0]):
        parts = []
        for a, b, slice_ranks in zip(lora_a, lora_b, ranks):
            acc = torch.zeros(b.shape[1], dtype=torch.float64)
            for j in range(token_slots.shape[1]):
                slot = int(token_slots[t, j])
                if slot < 0 or slice_ranks[slot] == 0:
                    continue
                r = slice_ranks[slot]
                acc += float(token_scales[t, j]) * (
                    b[slot, :, :r].double() @ (a[slot, :r].double() @ x[t].double())
                )
            parts.append(acc)
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def test_reference_matches_dense_loop() -> None:
    g = torch.Generator().manual_seed(1)
    tokens, k, slots, r_max, d_in, outs = 9, 3, 4, 8, 12, [10, 6]
    ranks = [[8, 3, 0, 1], [0, 8, 5, 2]]
    lora_a = [torch.randn(slots, r_max, d_in, generator=g) for _ in outs]
    lora_b = [torch.randn(slots, o, r_max, generator=g) for o in outs]
    token_slots = torch.randint(-1, slots, (tokens, k), generator=g)
    scales = torch.rand(tokens, k, generator=g)
    x = torch.randn(tokens, d_in, generator=g)
    y = torch.zeros(tokens, sum(outs))
    meta: LoraMeta = build_lora_meta(token_slots, scales, slots)
    add_lora_reference(y, x, lora_a, lora_b, ranks, meta)
    torch.testing.assert_close(
        y.double(), dense_lora(x, token_slots, scales, lora_a, lora_b, ranks), rtol=1e-5, atol=1e-5
    )


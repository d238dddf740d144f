"""build_lora_meta against a plain-Python oracle, and the torch reference against a dense loop."""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.lora_ops import LoraMeta, add_lora_reference, build_lora_meta, max_chunks_for


def oracle_meta(token_slots: list[list[int]], chunk_size: int) -> tuple[list[tuple[int, int, float]], list]:
    """(slot, token, entry) pairs sorted by slot then by (token, entry); chunks as (slot, start, end)."""
    pairs = [(slot, t, j) for t, row in enumerate(token_slots) for j, slot in enumerate(row) if slot >= 0]
    pairs.sort(key=lambda p: (p[0], p[1], p[2]))
    chunks = []
    i = 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0] and j - i < chunk_size:
            j += 1
        chunks.append((pairs[i][0], i, j))
        i = j
    return pairs, chunks


MAPPINGS = {
    "random_with_none": lambda g, t, k, s: torch.randint(-1, s, (t, k), generator=g),
    "one_adapter": lambda g, t, k, s: torch.full((t, k), 2),
    "each_token_own": lambda g, t, k, s: (torch.arange(t * k) % s).reshape(t, k),
    "all_none": lambda g, t, k, s: torch.full((t, k), -1),
    "sparse_slots": lambda g, t, k, s: torch.where(torch.rand(t, k, generator=g) < 0.5, -1, s - 1),
}


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
@pytest.mark.parametrize(
    "tokens,k,slots,chunk_size", [(1, 1, 4, 16), (37, 2, 8, 16), (70, 3, 5, 16), (90, 1, 64, 32)]
)
def test_build_lora_meta_matches_oracle(
    mapping: str, tokens: int, k: int, slots: int, chunk_size: int
) -> None:
    g = torch.Generator().manual_seed(tokens * 31 + k)
    token_slots = MAPPINGS[mapping](g, tokens, k, slots).to(torch.int32)
    scales = torch.rand(tokens, k, generator=g)
    meta = build_lora_meta(token_slots, scales, slots, chunk_size=chunk_size)
    pairs, chunks = oracle_meta(token_slots.tolist(), chunk_size)

    assert meta.num_entries == len(pairs)
    n = len(pairs)
    assert meta.sorted_token[:n].tolist() == [t for _, t, _ in pairs]
    assert torch.equal(meta.sorted_scale[:n], torch.tensor([float(scales[t, j]) for _, t, j in pairs]))
    seg_slots = sorted({p[0] for p in pairs})
    assert meta.num_segments == len(seg_slots)
    assert meta.seg_slot.tolist() == seg_slots + [-1] * (slots - len(seg_slots))
    bounds = [sum(1 for p in pairs if p[0] < s) for s in seg_slots] + [n]
    assert meta.seg_start.tolist() == bounds + [n] * (slots + 1 - len(bounds))
    assert meta.segments == [(s, bounds[i], bounds[i + 1]) for i, s in enumerate(seg_slots)]

    # Chunks: the oracle's, then padding with slot -1; the buffer size depends on shapes only.
    assert meta.max_chunks == max_chunks_for(tokens * k, slots, chunk_size) >= len(chunks)
    assert meta.num_chunks == len(chunks)
    got = list(zip(meta.chunk_slot.tolist(), meta.chunk_start.tolist(), meta.chunk_end.tolist()))
    assert got[: len(chunks)] == chunks
    assert all(slot == -1 for slot, _, _ in got[len(chunks) :])
    # has_lora: the tokens with at least one adapter (the rows a storing expand writes).
    assert meta.has_lora.tolist() == [int(any(s >= 0 for s in row)) for row in token_slots.tolist()]


def test_has_lora_for_empty_shapes() -> None:
    """No tokens, or no adapter entries per token: an empty or all-zero mask, not an error."""
    assert build_lora_meta(torch.zeros(0, 1, dtype=torch.int32), torch.ones(0, 1), 4).has_lora.tolist() == []
    assert build_lora_meta(torch.zeros(3, 0, dtype=torch.int32), torch.ones(3, 0), 4).has_lora.tolist() == [0, 0, 0]


def test_max_chunks_is_an_upper_bound_for_every_mapping() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens, k, slots = (
            int(torch.randint(1, 80, (1,), generator=g)),
            2,
            int(torch.randint(1, 40, (1,), generator=g)),
        )
        token_slots = torch.randint(-1, slots, (tokens, k), generator=g)
        meta = build_lora_meta(token_slots, torch.ones(tokens, k), slots)
        assert meta.num_chunks <= meta.max_chunks


def test_meta_copy_keeps_buffers_and_takes_contents() -> None:
    a = build_lora_meta(torch.tensor([[0], [1], [-1]]), torch.ones(3, 1), 4)
    b = build_lora_meta(torch.tensor([[3], [-1], [2]]), torch.full((3, 1), 0.5), 4)
    assert a.has_lora.tolist() == [1, 1, 0] and b.has_lora.tolist() == [1, 0, 1]
    buf = a.chunk_slot
    a.copy_(b)
    assert a.chunk_slot is buf and a.chunk_slot.tolist() == b.chunk_slot.tolist()
    assert a.segments == b.segments and a.num_entries == 2
    fields = ("token_slots", "token_scales", "sorted_token", "sorted_scale", "seg_slot", "seg_start",
              "chunk_slot", "chunk_start", "chunk_end", "has_lora")
    for name in fields:  # the packed two-buffer copy reaches every field
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError):
        a.copy_(build_lora_meta(torch.tensor([[0]]), torch.ones(1, 1), 4))


def test_build_lora_meta_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        build_lora_meta(torch.tensor([[4]]), torch.ones(1, 1), 4)
    with pytest.raises(ValueError):
        build_lora_meta(torch.tensor([[0]]), torch.ones(1, 1), 4, chunk_size=24)


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


def test_gemm_sm_carveout_setting() -> None:
    """LORAFLEET_GEMM_SM_CARVEOUT: (few, many) beside small then large GEMMs; "few,many" for both
    sizes, one number for all four; anything else is refused."""
    from lorafleet.kernels.lora_ops import _carveouts

    assert _carveouts("32,48") == (32, 48, 32, 48) and _carveouts("16") == (16,) * 4 and _carveouts("0") == (0,) * 4
    assert _carveouts("32,48,8,40") == (32, 48, 8, 40)
    for bad in ("", "x", "1,2,3", "1,2,3,4,5", "-4", "8,-1"):
        with pytest.raises(ValueError, match="LORAFLEET_GEMM_SM_CARVEOUT"):
            _carveouts(bad)


def test_gemm_sm_carveout_context_restores_the_setting() -> None:
    from lorafleet.kernels.lora_ops import gemm_sm_carveout

    before = torch._C._get_sm_carveout_experimental()
    with gemm_sm_carveout(24):
        assert torch._C._get_sm_carveout_experimental() == 24
    assert torch._C._get_sm_carveout_experimental() == before
    with gemm_sm_carveout(0):  # 0: nothing set
        assert torch._C._get_sm_carveout_experimental() == before

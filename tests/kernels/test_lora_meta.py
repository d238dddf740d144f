"""build_lora_meta against a plain-Python oracle; LoraMeta's copy_ and one-pair chunks."""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.lora.meta import build_lora_meta, max_chunks_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


def test_one_pair_chunks_from_the_counts_unless_set() -> None:
    """A meta judges its chunks from its own counts: more than tuning.one_pair_min_chunks of them, at
    most tuning.one_pair_chunks[0] pairs each on average, none longer than one_pair_chunks[1];
    `one_pair`, which a decode graph sets from the step, overrides that."""
    from dataclasses import replace

    from lorafleet.kernels.lora.tuning import active_tuning

    def meta(slots: list[int]):
        return build_lora_meta(torch.tensor(slots, dtype=torch.int32)[:, None], torch.ones(len(slots), 1), 64, DEVICE)

    tuning = active_tuning()
    assert tuning.one_pair_min_chunks == 16 and tuning.one_pair_chunks == (1.5, 2)
    each = meta(list(range(32)))  # 32 chunks of one
    few = meta(list(range(16)))  # 16 chunks of one: not more than one_pair_min_chunks
    twos = meta([t // 2 for t in range(64)])  # 32 chunks of two: 2 on average
    long = meta(list(range(30)) + [40] * 10)  # 31 chunks, 1.3 on average, but one of 10
    mixed = meta(list(range(24)) + [30, 30, 31, 31, 32, 32])  # 27 chunks, 1.1 on average, none over 2
    none = meta([-1] * 32)
    assert each.one_pair_chunks and mixed.one_pair_chunks
    assert not any(m.one_pair_chunks for m in (few, twos, long, none))
    assert twos.one_pair_chunks_for(replace(tuning, one_pair_chunks=(2.0, 2)))  # a tuning passed in
    assert not each.one_pair_chunks_for(replace(tuning, one_pair_min_chunks=32))
    twos.one_pair = True
    each.one_pair = False
    assert twos.one_pair_chunks and not each.one_pair_chunks



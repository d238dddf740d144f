"""KV block accounting and the prefix cache (keyed by adapter set as well as tokens)."""

from __future__ import annotations

from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.sequence import SamplingParams, Sequence


def seq(tokens: list[int], salt: str = "", sid: int = 0) -> Sequence:
    return Sequence(seq_id=sid, prompt_ids=list(tokens), sampling=SamplingParams(), cache_salt=salt)


def fill(bm: BlockManager, s: Sequence) -> None:
    assert bm.allocate(s, len(s))
    s.num_computed = len(s)
    bm.register_full_blocks(s)


def test_allocate_and_free_account_for_every_block():
    bm = BlockManager(8, 4)
    s = seq(list(range(10)))
    assert bm.allocate(s, 10) and len(s.block_table) == 3
    assert bm.num_free == 5 and abs(bm.usage() - 3 / 8) < 1e-9
    assert not bm.allocate(seq(list(range(40)), sid=1), 40)  # needs 10 > 5: nothing changes
    assert bm.num_free == 5
    bm.free(s)
    assert bm.num_free == 8


def test_prefix_shared_only_under_the_same_adapters():
    bm = BlockManager(16, 4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    first = seq(prompt, salt="sql")
    fill(bm, first)
    same = seq(prompt, salt="sql", sid=1)
    assert bm.match_prefix(same) == 12 and same.block_table == first.block_table[:3]
    other = seq(prompt, salt="chat", sid=2)
    assert bm.match_prefix(other) == 0  # an adapter changes the keys and values
    base = seq(prompt, salt="", sid=3)
    assert bm.match_prefix(base) == 0


def test_last_token_is_always_recomputed():
    bm = BlockManager(16, 4)
    first = seq(list(range(8)))
    fill(bm, first)
    again = seq(list(range(8)), sid=1)
    assert bm.match_prefix(again) == 4  # not 8: the step needs logits for the last token


def test_cached_blocks_survive_free_and_are_evicted_lru():
    bm = BlockManager(4, 4)
    a = seq(list(range(8)), salt="x")
    fill(bm, a)
    bm.free(a)
    assert bm.num_free == 4  # evictable blocks count as free
    b = seq(list(range(9)), salt="x", sid=1)
    assert bm.match_prefix(b) == 8  # still cached after free
    bm.free(b)
    big = seq(list(range(100, 116)), salt="y", sid=2)
    assert bm.allocate(big, 16)  # takes every block, evicting the cached ones
    c = seq(list(range(9)), salt="x", sid=3)
    assert bm.match_prefix(c) == 0


def test_diverging_prompts_share_the_common_blocks_only():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    fill(bm, a)
    b = seq([1, 2, 3, 4, 9, 9, 9, 9, 9], sid=1)
    assert bm.match_prefix(b) == 4

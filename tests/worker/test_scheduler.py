"""Scheduler tables: max_loras, deferral, aging, token budget, preemption (no torch, no model)."""

from __future__ import annotations

import itertools

import pytest

from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.scheduler import Scheduler, SchedulerConfig
from lorafleet.worker.engine.sequence import SamplingParams, Sequence

_ids = itertools.count()


def seq(adapters: str = "", prompt_len: int = 4, max_tokens: int = 4) -> Sequence:
    """`adapters` like "a" or "a+b" ("" = base only)."""
    names = [n for n in adapters.split("+") if n]
    return Sequence(
        seq_id=next(_ids), prompt_ids=list(range(1, prompt_len + 1)), sampling=SamplingParams(max_tokens=max_tokens),
        adapters=tuple((n, 1.0) for n in names), cache_salt=adapters,
    )


def make(max_loras=2, max_num_seqs=16, budget=256, num_blocks=256, block_size=4, aging=4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_loras, aging), BlockManager(num_blocks, block_size))


def run_step(s: Scheduler):
    """One step as the engine does it, with every sampled request getting a token (and finishing at max_tokens)."""
    batch = s.schedule()
    for q in s.postprocess(batch):
        q.output_ids.append(7)
        if len(q.output_ids) >= q.sampling.max_tokens:
            s.finish(q, "length")
    return batch


@pytest.mark.parametrize(
    "max_loras, waiting, admitted, deferred",
    [
        # adapters of waiting requests, in order -> which run this step, which are deferred
        (2, ["a", "b", "c", ""], ["a", "b", ""], ["c"]),
        (2, ["a", "c", "a", "b"], ["a", "c", "a"], ["b"]),  # a deferred request does not block a later "a"
        (1, ["a", "b", "a", ""], ["a", "a", ""], ["b"]),
        (3, ["a+b", "c", "d"], ["a+b", "c"], ["d"]),  # each adapter of a composed request counts
        (2, ["a+b+c", "a"], ["a"], ["a+b+c"]),  # a composed request that cannot fit waits
        (4, ["a", "b", "c", "d", "a+d"], ["a", "b", "c", "d", "a+d"], []),
    ],
)
def test_max_loras_and_deferral(max_loras, waiting, admitted, deferred):
    s = make(max_loras=max_loras)
    seqs = [seq(a) for a in waiting]
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    assert ["+".join(n for n, _ in q.adapters) for q in batch.seqs] == admitted
    assert ["+".join(n for n, _ in q.adapters) for q in batch.deferred] == deferred
    assert len(batch.adapters) <= max_loras
    assert s.deferred_total == len(deferred)


def test_running_adapters_keep_their_slots_and_base_requests_flow():
    s = make(max_loras=2)
    for a in ["a", "b"]:
        s.add(seq(a, max_tokens=50))
    run_step(s)
    s.add(seq("c"))
    s.add(seq(""))
    s.add(seq("a"))
    batch = s.schedule()
    names = sorted("+".join(n for n, _ in q.adapters) for q in batch.seqs)
    assert names == ["", "a", "a", "b"]
    assert [q.adapters for q in batch.deferred] == [(("c", 1.0),)]


def test_no_adapter_starves_under_an_adversarial_stream():
    # Requests for a and b arrive every step forever; c would wait forever without aging.
    s = make(max_loras=2, aging=4)
    victim = seq("c", max_tokens=2)
    s.add(seq("a", max_tokens=3))
    s.add(seq("b", max_tokens=3))
    s.add(victim)
    for step in range(60):  # noqa: B007 - read after the loop
        s.add(seq("a", max_tokens=3))
        s.add(seq("b", max_tokens=3))
        s.add(seq("", max_tokens=3))
        batch = run_step(s)
        assert len(batch.adapters) <= 2
        if victim.finished:
            break
    assert victim.finished, "adapter c starved"
    assert step < 20


def test_token_budget_chunks_a_long_prefill():
    s = make(budget=10, block_size=4)
    long = seq("", prompt_len=25, max_tokens=1)
    s.add(long)
    chunks = []
    while not long.finished:
        batch = run_step(s)
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [10, 10, 5]


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    for _ in range(5):
        s.add(seq(""))
    assert len(s.schedule().seqs) == 2


def test_preemption_when_blocks_run_out_recomputes_the_newest():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens grow until one must be preempted.
    s = make(num_blocks=6, block_size=4, max_loras=4)
    a, b, c = seq("a", 8, 10), seq("b", 8, 10), seq("", 8, 10)
    for q in (a, b, c):
        s.add(q)
    run_step(s)  # prefill all three: 6 blocks used
    batch = run_step(s)  # decode needs a 3rd block for a: c (newest) is preempted
    assert c in batch.preempted and c.num_computed == 0 and not c.block_table
    assert s.waiting[0] is c and c.num_preemptions == 1
    while not (a.finished and b.finished):
        run_step(s)
    while not c.finished:
        run_step(s)
    assert len(c.output_ids) == 10
    assert s.preempted_total >= 1
    assert s.blocks.num_free == 6  # every block came back


def test_adapter_not_ready_is_skipped_without_blocking():
    ready = {"a"}
    s = Scheduler(SchedulerConfig(8, 256, 4), BlockManager(64, 4), adapter_ready=lambda n: n in ready)
    loading, fine = seq("b"), seq("a")
    s.add(loading)
    s.add(fine)
    batch = s.schedule()
    assert batch.seqs == [fine] and batch.not_ready == [loading]
    ready.add("b")
    assert loading in s.schedule().seqs

"""The admission dry run that async scheduling relies on, against admission itself (torch-free):
`Scheduler.hold_admission` agrees with `schedule()` and counts deferrals as it does, and
`BlockManager.admission_cost` is what admission takes from the free blocks."""

from __future__ import annotations

from lorafleet.worker.engine.sequence import SamplingParams


def _scheduler_state(rng, prefix_caching: bool):
    """A scheduler mid-decode: running requests one token behind, waiting ones (some sharing cached
    prompt blocks, some for adapters that are not ready), KV blocks from plenty to scarce."""
    from lorafleet.worker.engine.block_manager import BlockManager
    from lorafleet.worker.engine.scheduler import Scheduler, SchedulerConfig
    from lorafleet.worker.engine.sequence import Sequence

    bs = 4
    blocks = BlockManager(rng.randint(12, 60), bs, prefix_caching)
    ready = {"a", "b", "c", "x"} - {rng.choice(["c", "x", "none"])}
    sched = Scheduler(SchedulerConfig(rng.randint(2, 8), rng.choice([8, 64]), rng.randint(1, 3), aging_steps=2),
                      blocks, adapter_ready=lambda name: name in ready)
    shared = [rng.randint(1, 50) for _ in range(3 * bs)]
    ids = iter(range(1000))

    def make(adapters):
        prompt = shared[: rng.choice([0, bs, 2 * bs, 3 * bs])] + [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
        return Sequence(seq_id=next(ids), prompt_ids=prompt, sampling=SamplingParams(max_tokens=50),
                        adapters=tuple((n, 1.0) for n in adapters), cache_salt="+".join(adapters))

    names = [(), ("a",), ("b",), ("c",), ("x",), ("a", "b")]
    for _ in range(rng.randint(1, 4)):
        sched.add(make(rng.choice(names)))
    batch = sched.schedule()  # admit and prefill some: they register cached blocks
    for q in sched.postprocess(batch):
        q.output_ids.append(rng.randint(1, 50))
    for q in list(sched.running):
        if q.num_uncomputed > 1 or rng.random() < 0.3:
            sched.finish(q, "length")  # mid-prompt ones out (not a decode batch); some freed to the cache
    for _ in range(rng.randint(0, 5)):
        sched.add(make(rng.choice(names)))
    for q in list(sched.waiting)[: rng.randint(0, 2)]:
        q.deferred_steps = rng.randint(0, 3)  # some starving
    return sched


def test_admission_dry_run_agrees_with_schedule():
    import copy
    import random

    rng = random.Random(0)
    held = admitted = 0
    for case in range(400):
        sched = _scheduler_state(rng, prefix_caching=case % 3 != 0)
        free = sched.blocks.num_free - sum(sched.blocks.blocks_needed(q, len(q)) for q in sched.running)
        if free < 0:
            continue  # the engine falls back before the dry run (preemption)
        real = copy.deepcopy(sched)
        before = sched.blocks.num_free
        hold = sched.hold_admission(list(sched.running), free)
        assert sched.blocks.num_free == before and not any(q.block_table for q in sched.waiting)  # read-only
        running = {q.seq_id for q in sched.running}
        new = [q for q in real.schedule().seqs if q.seq_id not in running]
        assert hold == (not new), f"case {case}"
        if hold:
            assert sched.deferred_total == real.deferred_total  # aging counted as schedule() counts
            assert [q.deferred_steps for q in sched.waiting] == [q.deferred_steps for q in real.waiting]
        held += hold
        admitted += not hold
    assert held > 50 and admitted > 50  # both outcomes exercised


def test_admission_cost_is_what_admission_takes():
    from lorafleet.worker.engine.block_manager import BlockManager
    from lorafleet.worker.engine.sequence import Sequence

    blocks = BlockManager(32, 4)
    first = Sequence(0, list(range(1, 14)), SamplingParams(), cache_salt="s")
    assert blocks.admission_cost(first, 64) == 4
    blocks.allocate(first, 13)
    first.num_computed = 13
    blocks.register_full_blocks(first)  # 3 full blocks cached
    same = Sequence(1, list(range(1, 14)) + [99], SamplingParams(), cache_salt="s")
    other_salt = Sequence(2, list(range(1, 14)), SamplingParams(), cache_salt="t")
    assert blocks.admission_cost(same, 64) == 1  # 3 blocks shared, 1 new (held by `first`: not free)
    assert blocks.admission_cost(other_salt, 64) == 4
    assert blocks.admission_cost(same, 2) == 1  # 12 cached + 2 tokens of budget: one block
    blocks.free(first)  # now the cached blocks are evictable: attaching them takes them from the pool
    for seq, budget in ((same, 64), (other_salt, 64), (same, 1)):
        cost, before = blocks.admission_cost(seq, budget), blocks.num_free
        blocks.match_prefix(seq)
        assert blocks.allocate(seq, seq.num_computed + min(seq.num_uncomputed, budget))
        assert before - blocks.num_free == cost
        blocks.free(seq)
        seq.num_computed = 0

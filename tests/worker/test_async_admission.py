"""Async admission (`EngineConfig.async_admission`, worker/engine/async_step.py): steps where prompt
chunks join the decodes are launched before the step in flight is read, against the synchronous
engine.

CPU, through the graph path's static buffers: requests arriving between steps (mixed adapters,
long prompts chunked over several steps, stop strings, max_tokens endings, seeded sampling,
logprobs, min_tokens and grammars on joining rows, aborts of rows in flight) get the same outputs,
in the same order per request, as with `async_scheduling=False`; no block is leaked; and the
admission steps themselves overlap (no drain), counted by the stepper.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.async_harness import MIXED, _engine, greedy
from tests.worker.test_async_scheduling import _both, _drive, _texts

LONG = "The quick brown fox jumps over the lazy dog and keeps running through the field " * 2


def _events(log: list[tuple[str, int]]):
    def hook(engine, call, ids):
        engine.async_steps.on_event = lambda kind, n: log.append((kind, n))
    return hook


def _ahead(events: list[tuple[str, int]]) -> int:
    """Steps whose successor was launched before they were read."""
    order = {event: i for i, event in enumerate(events)}
    return sum(1 for kind, n in events if kind == "read" and order.get(("launch", n + 1), 1 << 30) < order[("read", n)])


def _staggered(n_tokens: int = 10):
    first = [(p, greedy(n_tokens + 2 * i), a) for i, (p, a) in enumerate(MIXED[:3])]
    later = [(p, greedy(4 + i), a) for i, (p, a) in enumerate(MIXED[3:])]
    return first, {3: later[:1], 4: later[1:3], 7: later[3:4], 8: [(LONG, greedy(5), (("sql", 1.0),))]}


def test_staggered_arrivals_join_without_draining(demo_model, modules):
    first, arrivals = _staggered()
    events: list[tuple[str, int]] = []
    want, got, sync, asyn = _both(demo_model, modules, first, arrivals=arrivals, on_step=_events(events))
    assert got == want
    assert [len(outs) for outs in got] == [10, 12, 14, 4, 5, 6, 7, 5]
    stats = asyn.async_steps.stats
    # Every request arriving mid-decode joined a step launched before the one in flight was read.
    assert stats.admitted == 5 and stats.joined >= 4
    assert set(stats.fallbacks) <= {"all_end"}  # only the last step, whose sequences all end
    assert _ahead(events) == stats.overlapped
    assert asyn.runner.logits_processors.rows_in_use == 0 and not asyn.runner._generators


def test_the_switch_off_drains_for_admissions(demo_model, modules):
    first, arrivals = _staggered()
    want, got, _, asyn = _both(demo_model, modules, first, arrivals=arrivals, async_admission=False)
    assert got == want
    stats = asyn.async_steps.stats
    assert stats.joined == stats.admitted == 0 and stats.fallbacks["admission"] >= 2


def test_long_prompts_chunked_over_async_steps(demo_model, modules):
    """Graphs of 16 rows: a prompt joining 3 decodes is chunked over several steps, each launched
    before the one in flight is read; its chunks that sample nothing keep their blocks while in flight."""
    first = [(p, greedy(24), a) for p, a in MIXED[:3]]
    later = [(LONG, greedy(6), ()), (LONG + "again", greedy(5), (("chat", 1.0),)), (MIXED[3][0], greedy(7), ())]
    silent: list[int] = []

    def watch(engine, call, ids):
        step = engine.async_steps.inflight
        if step is not None:
            silent.extend(seq.seq_id for seq in step.silent)

    kw = dict(max_graph_tokens=16, max_num_batched_tokens=32, block_size=8)
    want, got, sync, asyn = _both(demo_model, modules, first, arrivals={3: later[:2], 6: later[2:]}, on_step=watch, **kw)
    assert got == want
    stats = asyn.async_steps.stats
    assert len(silent) >= 4  # chunks short of their prompt's end, in flight
    assert stats.admitted == 3 and stats.joined >= 6 and stats.fallbacks["admission"] == 0


def test_stops_max_tokens_seeds_and_logprobs_while_joining(demo_model, modules):
    base = [(p, greedy(12), a) for p, a in MIXED[:4]]
    plain = _texts(_drive(_engine(demo_model, modules, False), base))
    stop_token = plain[1][0][2]
    text3 = plain[3][1]
    stop_str = text3[len(text3) // 3 : len(text3) // 3 + 2] if len(text3) >= 6 else text3[-2:]
    first = [base[0], (base[1][0], greedy(12, stop_token_ids=(stop_token,)), base[1][2])]
    later = [(base[3][0], greedy(12, stop=(stop_str,)), base[3][2]),
             (MIXED[4][0], SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True, logprobs=2), MIXED[4][1]),
             (MIXED[5][0], greedy(1), MIXED[5][1]),  # ends in the step it joins
             (MIXED[6][0], SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=8, ignore_eos=True), MIXED[6][1]),
             (base[2][0], greedy(7, logprobs=0), base[2][2])]
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={3: later[:2], 4: later[2:4], 7: later[4:]})
    assert got == want
    reasons = [outs[-1][3] for outs in got]
    assert reasons[1] == reasons[2] == "stop" and reasons[4] == "length" and len(got[4]) == 1
    stats = asyn.async_steps.stats
    assert stats.admitted == 5 and stats.fallbacks["admission"] == 0 and stats.discarded >= 2


def test_joining_rows_whose_edits_count_outputs_are_sampled_after_the_read(demo_model, modules):
    """min_tokens counts a row's outputs: a joining row has none in flight, the decodes one each, so
    such a step is sampled once the step before is read (deferred), still without a drain."""
    eos = 1
    first = [(p, greedy(14), a) for p, a in MIXED[:3]]
    later = [(MIXED[3][0], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=1, logit_bias=((eos, 8.0),)), ()),
             (MIXED[4][0], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4, logit_bias=((eos, 8.0),),
                                          frequency_penalty=0.5), MIXED[4][1])]
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={2: later[:1], 4: later[1:]})
    assert got == want
    assert [len(o) for o in got[3:]] == [2, 5]  # EOS, pushed up, right after min_tokens
    stats = asyn.async_steps.stats
    assert stats.admitted == 2 and stats.deferred >= 2 and stats.fallbacks["admission"] == 0


def test_grammar_requests_join_through_deferred_sampling(demo_model, modules):
    pytest.importorskip("xgrammar")
    from lorafleet.worker.sampling.structured import Constraint

    choice = Constraint.choice(["yes", "no", "maybe so"], "guided_choice")
    first = [(p, greedy(12), a) for p, a in MIXED[:2]]
    later = [(MIXED[2][0], SamplingParams(max_tokens=10, temperature=0.0, constraint=choice), MIXED[2][1]),
             (MIXED[3][0], SamplingParams(max_tokens=10, temperature=0.0,
                                          constraint=Constraint("regex", "[a-z ]{12}", "guided_regex")), ())]
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={2: later[:1], 3: later[1:]})
    assert got == want
    assert _texts(got)[2][1] in ("yes", "no", "maybe so")
    stats = asyn.async_steps.stats
    assert stats.admitted == 2 and stats.fallbacks["admission"] == 0 and stats.deferred >= 2


def test_without_deferred_sampling_such_rows_run_synchronously(demo_model, modules):
    later = [(MIXED[3][0], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3), ())]
    first = [(p, greedy(10), a) for p, a in MIXED[:2]]
    sync, asyn = _engine(demo_model, modules, False), _engine(demo_model, modules, True)
    asyn.async_steps.defer_sampling = False
    assert _drive(asyn, first, {2: later}) == _drive(sync, first, {2: later})
    stats = asyn.async_steps.stats
    assert stats.admitted == 0 and stats.fallbacks["admission"] >= 1


def test_abort_of_a_joining_row_in_flight(demo_model, modules):
    """A request aborted while its first prompt chunk is in flight keeps its blocks until that step
    is read; nothing is emitted for it, and every block comes back."""
    kw = dict(max_graph_tokens=16, max_num_batched_tokens=32, block_size=8)
    engine = _engine(demo_model, modules, True, **kw)
    start = engine.blocks.num_free
    ids = [engine.add_request(p, greedy(16), a) for p, a in MIXED[:3]]
    seen: dict[int, list[int]] = {}
    victim = None
    calls = 0
    while engine.has_unfinished():
        if calls == 3:
            victim = engine.add_request(LONG, greedy(6), (("sql", 1.0),))
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        calls += 1
        step = engine.async_steps.inflight
        if victim is not None and step is not None and any(s.seq_id == victim for s in step.silent):
            seq = engine._tracked[victim].seq
            engine.abort(victim)
            assert seq.block_table and engine.async_steps.holds(seq)  # the step in flight writes them
            for out in engine.step():
                seen.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert not seq.block_table
            victim = -1
    assert victim == -1 and -1 not in seen
    assert all(len(seen[rid]) == 16 for rid in ids)
    assert engine.blocks.num_free == start and engine.async_steps.stats.admitted >= 1


def test_max_num_seqs_and_kv_limits_while_joining(demo_model, modules):
    """Admission under max_num_seqs and a small KV cache (FCFS, preemption falls back): the same outputs."""
    first = [(p, greedy(10), a) for p, a in MIXED[:3]]
    later = [(p, greedy(5 + i), a) for i, (p, a) in enumerate(MIXED[3:])]
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={2: later[:3], 5: later[3:]}, max_num_seqs=4)
    assert got == want
    assert asyn.async_steps.stats.admitted >= 3
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={2: later[:3]}, block_size=8, num_kv_blocks=12,
                               enable_prefix_caching=False)
    assert got == want
    assert asyn.async_steps.stats.overlapped > 0


def test_async_admission_flag_reaches_the_engine_config():
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    def flag(*flags: str) -> bool:
        return settings_from_args(build_parser().parse_args(["--model", "m", *flags])).engine.async_admission

    assert flag() is False and flag("--async-admission") is True


# -- Scheduler.admit_beside against schedule() (torch-free) --------------------------------------


def test_admit_beside_admits_what_schedule_admits():
    """Mid-decode states of every kind (tests/worker/test_admission_dry_run.py): beside the running
    decodes, with every row allowed to join and the graphs' limits out of reach, the same requests
    with the same chunks, blocks and deferral counts as `schedule()`; with no row allowed, nothing
    changes (the engine then runs `schedule()`, which counts the deferrals)."""
    import copy
    import random

    from tests.worker.test_admission_dry_run import _scheduler_state

    rng = random.Random(1)
    admitted = blocked = 0
    for case in range(300):
        sched = _scheduler_state(rng, prefix_caching=case % 3 != 0)
        if sched.blocks.num_free < sum(sched.blocks.blocks_needed(q, len(q)) for q in sched.running):
            continue  # the engine falls back before admission (preemption)
        real, refused = copy.deepcopy(sched), copy.deepcopy(sched)
        want = real.schedule()
        decoding = list(sched.running)
        for q in decoding:  # the step in flight's blocks for the decodes' tokens
            assert sched.blocks.allocate(q, len(q))
        ids = {q.seq_id for q in decoding}
        got, stopped = sched.admit_beside(decoding, ids, 1 << 20, 1 << 20, lambda q: True)
        assert not stopped
        new = [(q.seq_id, n) for q, n in zip(want.seqs, want.num_new_tokens) if q.seq_id not in ids]
        assert [(q.seq_id, n) for q, n in zip(got.seqs, got.num_new_tokens)] == new, f"case {case}"
        assert [q.block_table for q in got.seqs] == [q.block_table for q in want.seqs if q.seq_id not in ids]
        assert sched.blocks.num_free == real.blocks.num_free
        assert [q.seq_id for q in sched.running] == [q.seq_id for q in real.running]
        assert sched.deferred_total == real.deferred_total
        admitted += bool(new)

        free, waiting, aged = refused.blocks.num_free, [q.seq_id for q in refused.waiting], refused.deferred_total
        none, stopped = refused.admit_beside(list(refused.running), ids, 1 << 20, 1 << 20, lambda q: False)
        assert not none and stopped == bool(new)
        assert refused.blocks.num_free == free and [q.seq_id for q in refused.waiting] == waiting
        assert not any(q.block_table for q in refused.waiting)
        if stopped:
            assert refused.deferred_total == aged  # counted by the synchronous step that runs instead
        blocked += stopped
    assert admitted > 50 and blocked > 50


def test_admit_beside_keeps_to_the_graphs_limits():
    from lorafleet.worker.engine.block_manager import BlockManager
    from lorafleet.worker.engine.scheduler import Scheduler, SchedulerConfig
    from lorafleet.worker.engine.sequence import Sequence

    sched = Scheduler(SchedulerConfig(8, 64, 2, mixed_step_tokens=16), BlockManager(64, 4, False))
    decoding = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=9)) for i in range(3)]
    for q in decoding:
        sched.add(q)
    sched.postprocess(sched.schedule())
    for q in decoding:
        q.output_ids.append(5)
        assert sched.blocks.allocate(q, len(q) + 1)
    long, short = Sequence(10, list(range(1, 30)), SamplingParams()), Sequence(11, [4, 4], SamplingParams())
    sched.add(long)
    sched.add(short)
    ids = {q.seq_id for q in decoding}
    got, stopped = sched.admit_beside(decoding, ids, 16, 8, lambda q: True)
    assert [(q.seq_id, n) for q, n in zip(got.seqs, got.num_new_tokens)] == [(10, 13)] and not stopped
    sched.postprocess(got)  # 13 of its 29 tokens computed; 16 left, beside 3 decodes again
    got, stopped = sched.admit_beside(decoding, ids, 16, 8, lambda q: True)
    assert [(q.seq_id, n) for q, n in zip(got.seqs, got.num_new_tokens)] == [(10, 13)] and not stopped
    sched.postprocess(got)
    got, stopped = sched.admit_beside(decoding, ids, 8, 4, lambda q: True)  # 5 rows left; 4 may sample
    assert [(q.seq_id, n) for q, n in zip(got.seqs, got.num_new_tokens)] == [(10, 3)] and stopped
    assert short in sched.waiting and not short.block_table


# -- the same comparison on CUDA too: captured graphs, mixed-row buckets captured while a step is in flight --

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_async_admission_matches_sync_on_device(demo_model, modules, device):
    """fp32: requests joining steps in flight, chunked prompts among them, seeded and greedy, give the
    synchronous engine's tokens (texts: on CUDA rows of other batch compositions agree to ~1e-6)."""
    first = [(p, greedy(20), a) for p, a in MIXED[:3]]
    later = [(LONG, greedy(6), ()), (MIXED[3][0], SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True),
                                     MIXED[3][1]), (LONG + "again", greedy(5), (("chat", 1.0),)),
             (MIXED[4][0], greedy(7, logprobs=2), MIXED[4][1])]
    kw = dict(device=device, dtype="float32", max_graph_tokens=32, max_num_batched_tokens=64, block_size=16)
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={3: later[:2], 5: later[2:]}, **kw)
    assert _texts(got) == _texts(want)
    stats = asyn.async_steps.stats
    assert stats.admitted == 4 and stats.joined >= 4 and stats.fallbacks["admission"] == 0
    assert asyn.runner.graphs.stats.replays > 0

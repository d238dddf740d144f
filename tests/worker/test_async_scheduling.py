"""Async scheduling (`EngineConfig.async_scheduling`, worker/engine/async_step.py) against the synchronous engine.

CPU, through the graph path's static buffers (`cuda_graphs=True` runs them without capture): the
same RequestOutputs, in the same order per request, for mixed adapters, stop strings and stop
token ids, per-request max_tokens, seeded sampling, logprobs, aborts, preemption and requests
arriving mid-decode; no block leaked; and the overlap itself: step n+1 is launched before step
n's tokens are read (an event hook, not timing).
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.outputs import RequestOutput
from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.async_harness import MIXED, _engine, greedy


def _key(out: RequestOutput) -> tuple:
    lps = [(lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top]) for lp in out.logprobs]
    return (out.new_token_ids, out.text_delta, out.finished, out.finish_reason, out.num_generated, lps)


def _drive(engine: LLMEngine, requests, arrivals: dict[int, list] | None = None, on_step=None) -> list[list[tuple]]:
    """Run to idle; `arrivals[k]`: requests added before the k-th step call. Per request (in the
    order added), the RequestOutputs it received, in order."""
    arrivals = {0: list(requests), **(arrivals or {})}
    ids: list[int] = []
    got: dict[int, list[tuple]] = {}
    calls = 0
    while engine.has_unfinished() or any(k >= calls for k in arrivals):
        for prompt, sp, adapters in arrivals.pop(calls, []):
            ids.append(engine.add_request(prompt, sp, adapters))
        if on_step is not None:
            on_step(engine, calls, ids)
        for out in engine.step():
            got.setdefault(out.request_id, []).append(_key(out))
        calls += 1
    return [got.get(rid, []) for rid in ids]


def _both(demo_model, modules, requests, arrivals=None, on_step=None, **kw):
    sync, asyn = _engine(demo_model, modules, False, **kw), _engine(demo_model, modules, True, **kw)
    free = asyn.blocks.num_free
    want = _drive(sync, requests, dict(arrivals or {}), on_step)
    got = _drive(asyn, requests, dict(arrivals or {}), on_step)
    assert asyn.blocks.num_free == free, "blocks leaked"
    assert not asyn.has_unfinished() and asyn.async_steps.inflight is None
    return want, got, sync, asyn


def _texts(outputs: list[list[tuple]]) -> list[tuple[list[int], str, str | None]]:
    return [([t for o in outs for t in o[0]], "".join(o[1] for o in outs), outs[-1][3]) for outs in outputs]


# -- equality with the synchronous engine ------------------------------------------------------


def test_mixed_batch_same_outputs_and_steps_overlap(demo_model, modules):
    requests = [(p, greedy(3 + 2 * i), a) for i, (p, a) in enumerate(MIXED)]  # leave at different steps
    events: list[tuple[str, int]] = []

    def hook(engine, call, ids):
        engine.async_steps.on_event = lambda kind, n: events.append((kind, n))

    want, got, sync, asyn = _both(demo_model, modules, requests, on_step=hook)
    assert got == want
    assert all(len(outs) == 3 + 2 * i for i, outs in enumerate(got))  # one output per token, as sync
    stats = asyn.async_steps.stats
    assert stats.overlapped >= 10 and asyn.runner.graphs.stats.replays > 0
    # Step n+1 was launched before step n's tokens were read, every time the path continued.
    order = {event: i for i, event in enumerate(events)}
    ahead = [n for kind, n in events if kind == "read" and order.get(("launch", n + 1), 1 << 30) < order[("read", n)]]
    assert len(ahead) == stats.overlapped
    assert sync.async_steps.stats.launched == 0
    assert asyn.steps >= sync.steps  # discarded rows aside, the same steps ran


def test_offline_generate_same_completions(demo_model, modules):
    prompts = [p for p, _ in MIXED]
    adapters = [a for _, a in MIXED]
    params = [greedy(2 + i) for i in range(len(MIXED))]
    sync, asyn = _engine(demo_model, modules, False), _engine(demo_model, modules, True)
    free = asyn.blocks.num_free
    want, got = sync.generate(prompts, params, adapters), asyn.generate(prompts, params, adapters)
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == [(c.token_ids, c.text, c.finish_reason) for c in want]
    assert asyn.async_steps.stats.overlapped > 0
    assert not asyn.has_unfinished() and asyn.blocks.num_free == free


EDITS = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, repetition_penalty=1.5),
         dict(repetition_penalty=0.5), dict(logit_bias=((1, 6.0),), min_tokens=7),  # 1: the demo model's EOS
         dict(logit_bias=((77, 2.0), (301, 1.5)), frequency_penalty=0.7),
         dict(temperature=1.0, seed=5, presence_penalty=1.0, min_p=0.05), {}, dict(allowed_token_ids=(5, 77, 301))]
EDITED = [(p, SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **e}), a) for (p, a), e in zip(MIXED, EDITS)]


def test_logit_edits_see_the_token_in_flight(demo_model, modules):
    """Penalties count, and min_tokens holds EOS back by, the tokens sampled so far, including the one
    still in flight, whose host copy the next step's launch has not read yet."""
    eos = 1
    want, got, _, asyn = _both(demo_model, modules, EDITED)
    assert got == want
    assert asyn.async_steps.stats.overlapped >= 5 and asyn.runner.logits_processors.rows_in_use == 0
    held = _texts(got)[3][0]
    assert len(held) == 8 and held[-1] == eos, "EOS, pushed up, came right after min_tokens"
    plain = _texts(_drive(_engine(demo_model, modules, False), [(p, greedy(12), a) for p, a in MIXED[:3]]))
    assert all(_texts(got)[i][0] != plain[i][0] for i in range(3)), "the penalties changed the tokens"


def test_stop_strings_and_stop_tokens_mid_batch(demo_model, modules):
    base = [(p, greedy(12), a) for p, a in MIXED[:6]]
    plain = _texts(_drive(_engine(demo_model, modules, False), base))
    # Stops that fire mid-batch: a token id request 1 emits at its 3rd step, a string request 3
    # produces a few tokens in, an include_stop_str variant on request 4; the rest run to length.
    stop_token = plain[1][0][2]
    text3 = plain[3][1]
    stop_str = text3[len(text3) // 3 : len(text3) // 3 + 2] if len(text3) >= 6 else text3[-2:]
    text4 = plain[4][1]
    stop_incl = text4[len(text4) // 2 : len(text4) // 2 + 2] if len(text4) >= 4 else text4
    assert stop_str and stop_incl
    requests = list(base)
    requests[1] = (base[1][0], greedy(12, stop_token_ids=(stop_token,)), base[1][2])
    requests[3] = (base[3][0], greedy(12, stop=(stop_str,)), base[3][2])
    requests[4] = (base[4][0], greedy(12, stop=(stop_incl,), include_stop_str_in_output=True), base[4][2])
    held: list[int] = []

    def check_held(engine, call, ids):
        # A request that stopped while its next row was in flight keeps its blocks until that is read.
        for seq in engine.async_steps._zombies:
            assert seq.finished and seq.block_table and engine.async_steps.holds(seq)
            held.append(seq.seq_id)

    want, got, _, asyn = _both(demo_model, modules, requests, on_step=check_held)
    assert got == want
    reasons = [outs[-1][3] for outs in got]
    assert reasons[1] == reasons[3] == reasons[4] == "stop"
    assert len(got[1]) == 3 and reasons.count("length") >= 2  # others kept decoding after the stops
    stats = asyn.async_steps.stats
    assert stats.overlapped > 0 and stats.discarded >= 3 and len(set(held)) >= 3


def test_seeded_sampling_same_tokens(demo_model, modules):
    knobs = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.2, top_k=50, top_p=0.8), dict(temperature=0.0)]
    requests = [(p, SamplingParams(max_tokens=10 + i, seed=100 + i, ignore_eos=True, **knobs[i % len(knobs)]), a)
                for i, (p, a) in enumerate(MIXED)]
    want, got, _, asyn = _both(demo_model, modules, requests)
    assert got == want
    assert asyn.async_steps.stats.overlapped > 0


def test_logprobs_equal(demo_model, modules):
    requests = [(p, greedy(6, logprobs=[None, 0, 3, 5][i % 4]), a) for i, (p, a) in enumerate(MIXED)]
    want, got, _, asyn = _both(demo_model, modules, requests)
    assert got == want  # _key rounds logprobs to 1e-4
    assert any(o[5] for outs in got for o in outs)
    assert asyn.async_steps.stats.overlapped > 0


def _host_token_requests():
    """Requests whose next token needs the host's view of the last one (grammars), among plain,
    seeded and edited ones; two of them end by their grammar while the rest still decode."""
    from lorafleet.worker.sampling.structured import Constraint

    choice = Constraint.choice(["yes", "no", "maybe so"], "guided_choice")
    knobs = [dict(), dict(constraint=choice), dict(temperature=1.0, seed=11,
                                                   constraint=Constraint("regex", "[a-z ]{40}", "guided_regex")),
             dict(frequency_penalty=0.8, constraint=Constraint("json_object", "", "response_format")),
             dict(temperature=0.9, seed=4, logit_bias=((77, 3.0),)), dict(temperature=1.0, seed=2, constraint=choice),
             dict(), dict(min_tokens=3, constraint=Constraint("regex", "[0-9]{2,6}", "guided_regex"))]
    return [(p, SamplingParams(**{"max_tokens": 14, "temperature": 0.0, **k}), a) for (p, a), k in zip(MIXED, knobs)]


def test_grammar_rows_are_sampled_after_the_step_before_is_read(demo_model, modules):
    """A batch with constrained rows stays on the async path: each next step's graph is replayed
    before the step in flight is read, and its sampling is queued once the grammars have taken that
    step's tokens. Same outputs as the synchronous engine; a constrained request that ends by its
    grammar leaves no edit row or generator behind for its discarded row."""
    pytest.importorskip("xgrammar")
    events: list[tuple[str, int]] = []

    def hook(engine, call, ids):
        engine.async_steps.on_event = lambda kind, n: events.append((kind, n))

    requests = _host_token_requests()
    want, got, sync, asyn = _both(demo_model, modules, requests, on_step=hook)
    assert got == want
    texts = _texts(got)
    assert texts[1][1] in ("yes", "no", "maybe so") and texts[1][2] == "stop" and texts[0][2] == "length"
    stats = asyn.async_steps.stats
    assert stats.deferred >= 5 and stats.deferred == stats.overlapped
    order = {event: i for i, event in enumerate(events)}
    ahead = [n for kind, n in events if kind == "read" and order.get(("launch", n + 1), 1 << 30) < order[("read", n)]]
    assert len(ahead) == stats.overlapped
    assert stats.discarded >= 1  # the choice rows' steps after their end
    assert asyn.runner.logits_processors.rows_in_use == 0 and not asyn.runner._generators


def test_without_deferred_sampling_grammar_batches_run_synchronously(demo_model, modules):
    """`AsyncStepper.defer_sampling` off: the old fallback (for benchmarks), the same outputs."""
    pytest.importorskip("xgrammar")
    requests = _host_token_requests()
    sync, asyn = _engine(demo_model, modules, False), _engine(demo_model, modules, True)
    asyn.async_steps.defer_sampling = False
    assert _drive(asyn, requests) == _drive(sync, requests)
    assert asyn.async_steps.stats.launched == 0
    plain = [(p, greedy(6), a) for p, a in MIXED[:3]]
    _drive(asyn, plain)
    assert asyn.async_steps.stats.overlapped > 0 and asyn.async_steps.stats.deferred == 0


# -- requests leaving and joining --------------------------------------------------------------


def test_abort_while_in_flight_frees_every_block(demo_model, modules):
    engine = _engine(demo_model, modules, True)
    start = engine.blocks.num_free
    ids = [engine.add_request(p, greedy(20), a) for p, a in MIXED[:5]]
    seen: dict[int, list[int]] = {rid: [] for rid in ids}
    aborted = False
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
        if not aborted and engine.async_steps.inflight is not None and len(seen[ids[1]]) >= 3:
            assert engine.async_steps.holds(engine._tracked[ids[1]].seq)
            victims = [engine._tracked[ids[i]].seq for i in (1, 3)]
            engine.abort(ids[1])
            engine.abort(ids[3])
            aborted = True
            stop_at = {rid: len(seen[rid]) for rid in (ids[1], ids[3])}
            assert all(seq.block_table for seq in victims)  # kept: the step in flight writes them
            for out in engine.step():
                seen[out.request_id].extend(out.new_token_ids)
            assert not any(seq.block_table for seq in victims)  # freed once that step was read
    assert aborted
    assert {rid: len(seen[rid]) for rid in (ids[1], ids[3])} == stop_at  # nothing after the abort
    assert all(len(seen[rid]) == 20 for rid in (ids[0], ids[2], ids[4]))
    assert engine.blocks.num_free == start and not engine.has_unfinished()
    assert engine.async_steps.stats.discarded >= 2


def test_preemption_falls_back_and_matches(demo_model, modules):
    prompts = ["Hello world", "The router sends each request", "Roses are red", "SELECT name FROM students"]
    adapters = [(), (("sql", 1.0),), (("chat", 1.0),), (("poem", 0.8), ("sql", 0.5))]
    requests = [(p, greedy(12), a) for p, a in zip(prompts, adapters)]
    want, got, sync, asyn = _both(demo_model, modules, requests, max_loras=4, block_size=8, num_kv_blocks=7,
                                  enable_prefix_caching=False)
    assert got == want
    assert asyn.scheduler.preempted_total > 0 and sync.scheduler.preempted_total > 0
    stats = asyn.async_steps.stats
    assert stats.fallbacks["preemption"] > 0 and stats.overlapped > 0


@pytest.mark.parametrize("admission", [False, True])
def test_requests_arriving_mid_decode(demo_model, modules, admission):
    """Admitted through a synchronous step (`async_admission` off), or joining a step launched
    before the one in flight is read (tests/worker/test_async_admission.py)."""
    first = [(p, greedy(14), a) for p, a in MIXED[:4]]
    later = [(p, greedy(6), a) for p, a in MIXED[4:]]
    want, got, _, asyn = _both(demo_model, modules, first, arrivals={5: later[:2], 9: later[2:]},
                               async_admission=admission)
    assert got == want
    stats = asyn.async_steps.stats
    assert stats.overlapped > 0
    assert (stats.admitted, stats.fallbacks["admission"] >= 2) == ((4, False) if admission else (0, True))


def test_deferred_requests_age_while_steps_skip_the_scheduler(demo_model, modules):
    """max_loras=2: requests for a third adapter wait (deferred, counted) while two adapters decode."""
    requests = [("Hello world", greedy(10), (("sql", 1.0),)), ("Roses are red", greedy(14), (("poem", 1.0),)),
                ("Hi there", greedy(5), (("chat", 1.0),)), ("Once upon", greedy(5), (("code", 1.0),))]
    want, got, sync, asyn = _both(demo_model, modules, requests, max_loras=2, max_cpu_loras=8)
    assert got == want
    assert asyn.scheduler.deferred_total > 0 and asyn.async_steps.stats.overlapped > 0
    assert asyn.scheduler.deferred_total == sync.scheduler.deferred_total


def test_max_num_seqs_holds_waiting_requests_in_async(demo_model, modules):
    requests = [(p, greedy(4 + i), a) for i, (p, a) in enumerate(MIXED)]
    want, got, _, asyn = _both(demo_model, modules, requests, max_num_seqs=3)
    assert got == want
    assert asyn.async_steps.stats.overlapped > 0


def test_error_token_ends_only_its_request(demo_model, modules, monkeypatch):
    """A row whose logits are not finite reads -1 (sampling.sample): that request ends with
    finish_reason=error while its extra row in the step in flight is discarded."""
    import lorafleet.worker.engine.model_runner as model_runner

    requests = [(p, greedy(8), a) for p, a in MIXED[:4]]
    want = _drive(_engine(demo_model, modules, False), requests)
    engine = _engine(demo_model, modules, True)
    victim: list[int] = []
    real = model_runner.sample_on_device

    def poisoned(logits, params, generators, greedy=None, edit=None):
        out = real(logits, params, generators, greedy, edit)
        if engine.async_steps.stats.launched == 3 and not victim:  # the 4th launched step
            victim.append(1)
            out.packed[1] = -1  # what a non-finite row reads as
        return out

    monkeypatch.setattr(model_runner, "sample_on_device", poisoned)
    start = engine.blocks.num_free
    got = _drive(engine, requests)
    assert got[1][-1][3] == "error" and got[1][:-1] == want[1][: len(got[1]) - 1]
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert engine.blocks.num_free == start


def test_prefix_cache_hashes_only_real_tokens(demo_model, modules):
    """With prefix caching on, async registers exactly the blocks (same hashes) sync registers."""
    requests = [(p, greedy(21), a) for p, a in MIXED[:5]] + [(MIXED[0][0], greedy(21), ())]
    want, got, sync, asyn = _both(demo_model, modules, requests, block_size=8)
    assert got == want
    assert set(asyn.blocks._block_of) == set(sync.blocks._block_of) and sync.blocks._block_of
    # Prompt + generated tokens again: hits blocks whose hashes cover tokens the async path appended.
    again = [(sync.tokenizer.encode(p) + tokens[:16], greedy(3), a)
             for (p, _, a), (tokens, _, _) in zip(requests[:3], _texts(want))]
    hits = asyn.blocks.prefix_hits
    assert _drive(asyn, again) == _drive(sync, again)
    assert asyn.blocks.prefix_hits == sync.blocks.prefix_hits >= hits + 3 * 16


# -- when it does not apply ----------------------------------------------------------------------


def test_without_graphs_or_with_a_logits_hook_steps_stay_synchronous(demo_model, modules):
    eager = _engine(demo_model, modules, True, cuda_graphs=False)
    eager.generate(["Hello world"], greedy(5))
    assert eager.async_steps.stats.launched == 0
    hooked = _engine(demo_model, modules, True)
    hooked.logits_hook = lambda seqs, logits: None
    hooked.generate(["Hello world", "Roses are red"], greedy(5))
    assert hooked.async_steps.stats.launched == 0
    hooked.logits_hook = None
    hooked.runner.graphs.enabled = False
    hooked.generate(["Hello world"], greedy(5))
    assert hooked.async_steps.stats.launched == 0


def test_has_unfinished_while_a_step_is_in_flight(demo_model, modules):
    plain = _engine(demo_model, modules, False).generate(["Hello world"], greedy(12))[0].token_ids
    k = next(i for i in range(2, 12) if plain[i] not in plain[:i])  # a token first emitted by an async step
    engine = _engine(demo_model, modules, True)
    start = engine.blocks.num_free
    rid = engine.add_request("Hello world", greedy(12, stop_token_ids=(plain[k],)), ())
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs.extend(engine.step())
    assert [o.new_token_ids[0] for o in outs] == plain[: k + 1] and outs[-1].finish_reason == "stop"
    assert {o.request_id for o in outs} == {rid}
    # The stop was read while the request's next row was in flight: still unfinished work.
    assert engine.async_steps.inflight is not None and engine.has_unfinished()
    assert engine.blocks.num_free < start
    assert engine.step() == []
    assert not engine.has_unfinished() and engine.blocks.num_free == start


def test_async_scheduling_flag_reaches_the_engine_config():
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    def flag(*flags: str) -> bool:
        return settings_from_args(build_parser().parse_args(["--model", "m", *flags])).engine.async_scheduling

    assert flag() is None  # resolved by the engine: on where decode steps replay CUDA graphs
    assert flag("--async-scheduling") is True
    assert flag("--no-async-scheduling") is False


# -- GPU (run on the H200): the same comparisons with captured graphs, pinned copies and events -----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_matches_sync_on_cuda(demo_model, modules):
    """fp32: rows of different batch compositions agree to ~1e-6, so tokens are equal (as in
    test_cuda_graphs); a step in flight also holds rows of requests that just ended."""
    knobs = [dict(temperature=0.0), dict(temperature=0.8, seed=7), dict(temperature=1.0, top_k=20, seed=3)]
    requests = [(p, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2 if i % 2 else None,
                                   **knobs[i % 3]), a) for i, (p, a) in enumerate(MIXED)]
    kw = dict(device="cuda", dtype="float32")
    want, got, sync, asyn = _both(demo_model, modules, requests, arrivals={4: requests[:2]}, **kw)
    assert _texts(got) == _texts(want)
    stats = asyn.async_steps.stats
    assert stats.overlapped > 0 and asyn.runner.graphs.stats.captures > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_logit_edits_async_match_sync_on_cuda(demo_model, modules):
    """The edits' device state under captured graphs and pinned copies: async as the synchronous engine."""
    want, got, _, asyn = _both(demo_model, modules, EDITED, device="cuda", dtype="float32")
    assert _texts(got) == _texts(want)
    assert asyn.async_steps.stats.overlapped >= 5 and asyn.runner.graphs.stats.captures > 0
    assert asyn.runner.logits_processors.rows_in_use == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grammar_rows_async_match_sync_on_cuda(demo_model, modules):
    """Deferred sampling under captured graphs and xgrammar's CUDA mask path: async as synchronous."""
    pytest.importorskip("xgrammar")
    want, got, _, asyn = _both(demo_model, modules, _host_token_requests(), device="cuda", dtype="float32")
    assert _texts(got) == _texts(want)
    assert asyn.async_steps.stats.deferred >= 5 and asyn.runner.graphs.stats.captures > 0
    assert asyn.runner.logits_processors.rows_in_use == 0 and not asyn.runner._generators

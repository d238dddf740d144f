"""Decode graphs under tensor parallelism (worker/engine/parallel.py, `RankGraphs`), on CPU over gloo:
every rank runs its own graphs' static-buffer path (`capture=False`: the whole protocol, without
capture), rank 0 choosing each step's graph and telling the others. Against the engine unsharded
(TP = 1, eager): a tiny random Llama, adapters of several ranks and a DoRA one, mixed batches, two
adapters per request, requests arriving while others decode (prompt chunks join the decodes in the
graphs). Greedy tokens equal and the first step's logprobs within 1e-4, and every forward on every
rank a graph step (counted on each rank: the test fails with the graphs off)."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lorafleet.worker.engine.cuda_graphs import DecodeGraphs
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.graph_inputs import decode_inputs, pack_inputs, unpack_inputs
from lorafleet.worker.engine.model_runner import ModelRunner
from lorafleet.worker.engine.parallel import Ranks, _bare_attn, _to, follower_args, free_port, init_group
from lorafleet.worker.engine.rank_graphs import RankGraphs, graph_counts
from lorafleet.worker.engine.scheduler import ScheduledBatch
from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.test_graph_inputs import _seq
from tests.worker.test_tensor_parallel import _engine_config, _wait_or_kill, assets, run_sharded  # noqa: F401

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
# step -> requests arriving then (prompt index, adapters): the later ones join decodes in progress.
ARRIVALS = {0: [(0, ())],  # a step without adapters first
            1: [(1, (("r4", 1.0),)), (2, (("r16", 1.0),))],
            3: [(3, (("r4", 0.5), ("r8", 0.7))), (6, (("r16", 0.3),))],
            5: [(4, (("r8", 1.0),)), (5, (("dora", 1.0),))],
            6: [(7, (("dora", 1.0),))]}


def _config(tp: int, graphs: bool):
    # Graphs of at most 8 sequences and 32 rows: the 20-token prompt joins decodes in one.
    return dataclasses.replace(_engine_config(tp), cuda_graphs=graphs, max_num_seqs=8, max_num_batched_tokens=32,
                               max_graph_tokens=32)


def _staggered(engine: LLMEngine, prompts) -> tuple[dict[int, tuple[list[int], object]], list[tuple[str, bool]]]:
    """Requests arriving while others decode -> {request: (tokens, first token's logprobs)} and each
    forward's (path, whether prompt tokens joined decodes in it)."""
    forwards: list[tuple[str, bool]] = []
    run = engine.runner.run

    def counted(batch, *args, **kwargs):
        out = run(batch, *args, **kwargs)
        ns = batch.num_new_tokens
        forwards.append((engine.runner.last_forward[0], any(n > 1 for n in ns) and any(n == 1 for n in ns)))
        return out

    engine.runner.run = counted
    results: dict[int, tuple[list[int], object]] = {}
    order = []
    step = 0
    while step <= max(ARRIVALS) or engine.has_unfinished():
        for i, adapters in ARRIVALS.get(step, []):
            order.append(engine.add_request(prompts[i], GREEDY, adapters))
        for out in engine.step():
            tokens, first = results.get(out.request_id, ([], None))
            results[out.request_id] = (tokens + out.new_token_ids, first or out.logprobs[0])
        step += 1
    assert len(results) == len(order) == 8
    return {rid: results[rid] for rid in order}, forwards


@pytest.fixture(scope="module")
def reference(assets):  # noqa: F811
    model_dir, adapters, prompts = assets
    return _staggered(LLMEngine(model_dir, _config(1, graphs=False), lora_modules=adapters), prompts)[0]


def _compare(reference, got) -> None:
    for (want_tokens, want), (tokens, have) in zip(reference.values(), got.values(), strict=True):
        assert tokens == want_tokens
        assert abs(want.logprob - have.logprob) < 1e-4
        assert [t for t, _ in want.top] == [t for t, _ in have.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(want.top, have.top)) < 1e-4


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_replays_its_graphs_like_tp1(assets, reference, tp):  # noqa: F811
    model_dir, adapters, prompts = assets

    def run(engine: LLMEngine):
        got, forwards = _staggered(engine, prompts)
        assert isinstance(engine.runner.graphs, RankGraphs)
        counts = graph_counts(engine.group, engine.runner.graphs, sum(path == "eager" for path, _ in forwards))
        return got, forwards, counts, engine.runner.graphs

    got, forwards, counts, graphs = run_sharded(model_dir, _config(tp, graphs=True), adapters, run)
    _compare(reference, got)
    assert len({tuple(tokens) for tokens, _ in reference.values()}) > 3  # the adapters change the outputs
    # Every forward a graph step, prompt chunks joining decodes among them, on every rank alike.
    assert forwards and all(path == "graph" for path, _ in forwards), forwards
    assert sum(mixed for _, mixed in forwards) >= 2
    assert counts == [{"replays": len(forwards), "graphs": counts[0]["graphs"], "eager": 0}] * tp
    assert graphs._dora_graphs and any(key[1] for key in graphs._graphs)  # DoRA's graphs, LoRA's, base ones
    assert any(key[1] == 0 for key in graphs._graphs)


def _mixed_batch() -> tuple[ScheduledBatch, dict[str, int]]:
    """Decodes with and without adapters (two with the same ones), a prompt's middle chunk and a
    prompt's last chunk, block 0 among the tables."""
    seqs = [_seq(0, [5, 6, 7], [8], [3], 3), _seq(1, [9] * 9, [4, 2], [0, 6], 10, (("a", 1.0),)),
            _seq(2, [9] * 9, [4, 3], [7, 1], 10, (("a", 1.0),)),
            _seq(3, list(range(10, 40)), [], [4, 5, 9, 11], 8, (("b", 0.5), ("a", 0.25))),
            _seq(4, list(range(50, 62)), [], [12, 13], 4, (("b", 1.0),))]
    return ScheduledBatch(seqs, [1, 1, 1, 16, 8]), {"a": 2, "b": 0}


def test_packed_inputs_rebuild_rank_0s_inputs_and_lora_meta():
    from lorafleet.kernels.lora.meta import build_lora_meta

    batch, slot_of = _mixed_batch()
    want = decode_inputs(batch, slot_of, 32, 6, 8, 2, 999, 8)
    got = unpack_inputs(pickle.loads(pickle.dumps(pack_inputs(want))), 32, 6, 8, 2, 999, 8)
    for field in dataclasses.fields(want):
        a, b = getattr(want, field.name), getattr(got, field.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    metas = [build_lora_meta(x.token_slots, x.token_scales, 4) for x in (want, got)]
    for a, b in zip(metas[0].packed, metas[1].packed):
        assert torch.equal(a, b)
    assert metas[0].segments == metas[1].segments and metas[0].num_chunks == metas[1].num_chunks
    packed = pack_inputs(want)
    assert packed.runs.tolist() == [1, 1, 1, 16, 8]  # a chunk's rows are sent once
    decodes = ScheduledBatch(batch.seqs[:3], [1, 1, 1])
    want = decode_inputs(decodes, slot_of, 4, 6, 8, 2, 999, 4)
    packed = pack_inputs(want)
    assert packed.runs is None and packed.tables.shape == (3, 2)  # a row per sequence; columns past 2 unused
    got = unpack_inputs(packed, 4, 6, 8, 2, 999, 4)
    assert all(torch.equal(getattr(want, f), getattr(got, f)) for f in ("input_ids", "positions", "slot_mapping",
                                                                         "block_tables", "context_lens", "token_slots",
                                                                         "token_scales", "logits_rows"))


def test_a_graph_step_sends_less_than_an_eager_forward():
    """The step command (what `RankGraphs.replay` broadcasts) against the eager forward's
    (`parallel.lead`'s), for the same batch, pickled as the gloo broadcast pickles them."""
    batch, slot_of = _mixed_batch()
    runner = SimpleNamespace(block_size=8, k=2, max_loras=4, device=torch.device("cpu"), model=SimpleNamespace(lora=None))
    ids, positions, attn, meta, rows, _ = ModelRunner.prepare(runner, batch, slot_of)
    eager = pickle.dumps(_to(("forward", ids, positions, _bare_attn(attn), meta, rows), torch.device("cpu")))
    inputs = decode_inputs(batch, slot_of, 32, 256, 8, 2, 999, 8)  # tables as wide as a 2048-token context
    graph = pickle.dumps(("graph", (32, 4, 16, False), False, pack_inputs(inputs)))
    assert len(graph) < len(eager) / 2, (len(graph), len(eager))
    decode = ScheduledBatch(batch.seqs[:3], [1, 1, 1])
    d_ids, d_pos, d_attn, d_meta, d_rows, _ = ModelRunner.prepare(runner, decode, slot_of)
    d_eager = pickle.dumps(_to(("forward", d_ids, d_pos, _bare_attn(d_attn), d_meta, d_rows), torch.device("cpu")))
    d_graph = pickle.dumps(("graph", (4, 1, 16, False), False, pack_inputs(decode_inputs(decode, slot_of, 4, 256, 8, 2,
                                                                                          999, 4))))
    assert len(d_graph) < len(d_eager) / 2, (len(d_graph), len(d_eager))


_BROKEN_CAPTURE = """
import sys
from lorafleet.worker.engine import cuda_graphs, parallel

def broken(self, bucket, *key):
    raise RuntimeError("out of graph memory (injected)")

cuda_graphs.DecodeGraphs._capture = broken
raise SystemExit(parallel.main(sys.argv[1:]))
"""


def test_a_capture_failing_on_a_follower_stops_every_rank(assets):  # noqa: F811
    model_dir, adapters, prompts = assets
    config = _config(2, graphs=True)
    init = f"tcp://127.0.0.1:{free_port()}"
    follower = subprocess.Popen([sys.executable, "-c", _BROKEN_CAPTURE, *follower_args(model_dir, config, init, 1)],
                                stderr=subprocess.PIPE)
    group = init_group(0, 2, init, torch.device("cpu"), timeout_s=60)
    ranks = Ranks(group, [follower])
    started = time.monotonic()
    try:
        engine = LLMEngine(model_dir, config, lora_modules=adapters, group=group)
        with pytest.raises(RuntimeError):
            engine.generate(prompts[:2], GREEDY)
    finally:
        dist.destroy_process_group()
        code = _wait_or_kill(follower)
    assert time.monotonic() - started < 60  # not the group's timeout
    assert code == 1
    assert "tensor-parallel rank 1 of 2 exited with code 1" in (ranks.failure() or "")
    err = follower.stderr.read().decode()
    assert "tensor-parallel rank 1 of 2 failed: RuntimeError: tensor-parallel rank 1: capturing the decode graph " in err
    assert "failed: RuntimeError: out of graph memory (injected)" in err, err


def test_rank_graphs_add_nothing_to_one_device(assets):  # noqa: F811
    """TP = 1 keeps the plain DecodeGraphs."""
    assert type(LLMEngine(assets[0], _config(1, graphs=True)).runner.graphs) is DecodeGraphs

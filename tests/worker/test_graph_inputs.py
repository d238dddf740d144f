"""Steps where prompt chunks join decodes, run from the decode graphs (`worker/engine/graph_inputs.py`,
`worker/engine/cuda_graphs.py`) against the eager engine.

On the H100 a step in which one prompt joined 63 decodes ran eagerly at ~30-50 ms against ~6.6 ms
for a decode step, and a closed loop at concurrency 64 delivered 0.23 of the engine's tokens/s
(docs/benchmarks.md, "The served path"). Here (CPU, no capture): the rows of such a step against
`ModelRunner.prepare`'s, the scheduler's budget beside decodes, and whole engines with requests
arriving while others decode: every step from the graphs' buffers, the same tokens and logits as
the eager engine (fp32: max |Δ| / max |eager| <= 1e-5, as tests/worker/test_cuda_graphs.py; on a
GPU, `-m gpu`, with captured graphs: 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.cuda_graphs import decode_inputs, graph_buckets, rows_graphable
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from lorafleet.worker.engine.sequence import SamplingParams, Sequence

from .peft_oracle import rel_err

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _seq(seq_id: int, prompt: list[int], outputs: list[int], table: list[int], computed: int, adapters=()) -> Sequence:
    seq = Sequence(seq_id=seq_id, prompt_ids=prompt, sampling=GREEDY, adapters=adapters)
    seq.output_ids = list(outputs)
    seq.num_computed = computed
    seq.block_table = list(table)
    return seq


def test_buckets_past_max_batch_for_mixed_steps():
    assert graph_buckets(64, 512) == [1, 2, 4, 8, 16, 32, 48, 64, 128, 192, 256, 320, 384, 448, 512]
    assert graph_buckets(8, 100) == [1, 2, 4, 8, 72, 100]
    assert graph_buckets(64, 64) == graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_rows_graphable():
    decode = _seq(0, [5, 6, 7], [8], [3], computed=3)
    chunk = _seq(1, list(range(10, 30)), [], [4, 5], computed=4)  # 16 of its 20 prompt tokens left
    assert rows_graphable(ScheduledBatch([decode, chunk], [1, 16]), max_rows=17, max_sampled=2)
    assert rows_graphable(ScheduledBatch([decode, chunk], [1, 5]), max_rows=17, max_sampled=1)  # a middle chunk
    assert not rows_graphable(ScheduledBatch([decode, chunk], [1, 16]), max_rows=16, max_sampled=2)
    assert not rows_graphable(ScheduledBatch([decode, chunk], [1, 16]), max_rows=17, max_sampled=1)
    scoring = _seq(2, list(range(10, 30)), [], [6, 7], computed=0)
    scoring.sampling = SamplingParams(max_tokens=4, prompt_logprobs=1)
    assert not rows_graphable(ScheduledBatch([decode, scoring], [1, 20]), max_rows=64, max_sampled=4)
    assert not rows_graphable(ScheduledBatch([], []), max_rows=64, max_sampled=4)


def test_mixed_rows_match_prepare(demo_model, modules):
    """A decode, a prompt's middle chunk (samples nothing), a prompt's last chunk after cached
    tokens, each token a row: ids, positions, slots, contexts and adapters as the eager step's."""
    engine = LLMEngine(demo_model, EngineConfig(max_loras=4, max_cpu_loras=8, block_size=8, num_kv_blocks=64),
                       lora_modules=modules)
    runner = engine.runner
    slot_of = {"sql": 0, "chat": 2}
    seqs = [
        _seq(0, list(range(11, 19)), [19, 20], [7, 9], computed=9),
        _seq(1, list(range(30, 50)), [], [1, 2, 3], computed=3, adapters=(("sql", 1.0),)),  # rows 3..9, no sample
        _seq(2, list(range(60, 73)), [], [4, 5], computed=8, adapters=(("chat", 0.5),)),  # rows 8..12, samples
    ]
    batch = ScheduledBatch(seqs, [1, 7, 5])
    ids, positions, attn, meta, rows, _ = runner.prepare(batch, slot_of)
    got = decode_inputs(batch, slot_of, 16, 2048 // 8, 8, runner.k, runner.sink_slot, logits_len=4)
    t = batch.num_tokens
    assert (got.num_rows, got.num_seqs, got.num_sampled) == (13, 3, 2)
    assert torch.equal(got.input_ids[:t], ids)
    assert torch.equal(got.positions[:t], positions)
    assert torch.equal(got.slot_mapping[:t], attn.slot_mapping)
    assert got.context_lens[:t].tolist() == [pos + 1 for pos in positions.tolist()]
    for row, seq_index in enumerate([0] + [1] * 7 + [2] * 5):
        table = seqs[seq_index].block_table
        assert got.block_tables[row, : len(table)].tolist() == table
    assert torch.equal(got.token_slots[:t], meta.token_slots)
    assert torch.equal(got.token_scales[:t], meta.token_scales)
    assert got.logits_rows.tolist() == rows.tolist() + [0, 0] == [0, 12, 0, 0]
    assert (got.slot_mapping[t:] == runner.sink_slot).all() and not got.context_lens[t:].any()


def test_budget_beside_decodes_chunks_prompts():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_loras=4, mixed_step_tokens=16)
    sched = Scheduler(config, BlockManager(64, 8, False))
    first = Sequence(seq_id=0, prompt_ids=list(range(10, 50)), sampling=GREEDY)
    sched.add(first)
    batch = sched.schedule()
    assert batch.num_new_tokens == [40]  # nothing decodes: the whole budget
    sched.postprocess(batch)
    first.output_ids.append(7)
    sched.add(Sequence(seq_id=1, prompt_ids=list(range(10, 50)), sampling=GREEDY))
    chunks = []
    while sched.waiting or sched.running[-1].num_uncomputed > 1:
        batch = sched.schedule()
        assert batch.num_tokens <= 16 and batch.seqs[0] is first
        chunks.append(batch.num_new_tokens[-1])
        sched.postprocess(batch)
        first.output_ids.append(7)
    assert chunks == [15, 15, 10]


@pytest.mark.parametrize("decoding, budget", [(0, 256), (1, 16), (8, 16), (9, 256), (200, 256)])
def test_the_graph_budget_holds_while_decodes_leave_half_the_rows(decoding, budget):
    """More decodes than half the graphs' rows: the whole budget (the step runs eagerly when prompt
    chunks join), so waiting prompts are not starved of tokens beside a large decode batch."""
    config = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=256, max_loras=4, mixed_step_tokens=16)
    assert config.budget(decoding) == budget


def test_prompts_beside_many_decodes_get_the_whole_budget():
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, max_loras=4, mixed_step_tokens=16)
    sched = Scheduler(config, BlockManager(256, 8, False))
    decoders = [Sequence(seq_id=i, prompt_ids=[10, 11], sampling=GREEDY) for i in range(12)]
    for seq in decoders:
        sched.add(seq)
    sched.postprocess(sched.schedule())
    for seq in decoders:
        seq.output_ids.append(7)
    sched.add(Sequence(seq_id=99, prompt_ids=list(range(10, 110)), sampling=GREEDY))
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 12 + [100]  # 12 decodes > 16 / 2: not chunked to the graph's 16 rows


def _engine(demo_model, modules, graphs: bool, device: str) -> LLMEngine:
    config = EngineConfig(max_loras=4, max_cpu_loras=8, device=device, cuda_graphs=graphs, num_kv_blocks=256,
                          warmup=False, enable_prefix_caching=False, max_num_seqs=8, max_graph_tokens=24,
                          dtype="float32")
    return LLMEngine(demo_model, config, lora_modules=modules)


def _staggered(engine: LLMEngine) -> tuple[dict[int, list[torch.Tensor]], list[bool]]:
    """Requests arriving while others decode; each step's logits of each request, and whether each
    forward ran eagerly."""
    logits: dict[int, list[torch.Tensor]] = {}
    eager: list[bool] = []
    forward = engine.model.forward

    def counted(*args, **kwargs):
        eager.append(not kwargs.get("graph", False))
        return forward(*args, **kwargs)

    def hook(seqs, rows):
        for seq, row in zip(seqs, rows):
            logits.setdefault(seq.seq_id, []).append(row.float().clone())

    engine.model.forward = counted
    engine.logits_hook = hook
    arrivals = {0: [("Hello world", (), 12), ("SELECT name FROM students", (("sql", 1.0),), 9)],
                3: [("The router sends each request to a worker", (("chat", 1.0),), 6)],
                5: [("Once upon a time " * 8, (), 5), ("Roses are red", (("poem", 1.0),), 7)],  # 40+ tokens: chunked
                6: [("def add(a, b):", (("sql", 0.5), ("code", 1.0)), 4)]}
    ids = []
    step = 0
    while step in arrivals or step <= max(arrivals) or engine.has_unfinished():
        for prompt, adapters, n in arrivals.get(step, []):
            ids.append(engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                          adapters))
        engine.step()
        step += 1
    assert len(ids) == 6
    return logits, eager


@pytest.mark.parametrize("device, tolerance", [
    ("cpu", 1e-5),
    # Captured graphs; the prompt rows' attention comes from the paged decode kernel where the eager
    # step calls SDPA: summed in another order.
    pytest.param("cuda", 1e-4, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA GPU")]),
])
def test_prompts_joining_decodes_run_in_the_graphs(demo_model, modules, device, tolerance):
    want_logits, eager_steps = _staggered(_engine(demo_model, modules, False, device))
    graph_engine = _engine(demo_model, modules, True, device)
    got_logits, graph_steps = _staggered(graph_engine)
    assert all(eager_steps)
    assert not any(graph_steps), "a step ran eagerly: a prompt joining decodes should replay a graph"
    assert graph_engine.runner.graphs.buckets[-1] == 24
    assert any(bucket > 8 for bucket, *_ in graph_engine.runner.graphs._graphs)  # rows past max_num_seqs
    assert want_logits.keys() == got_logits.keys() and len(want_logits) == 6
    for rid in want_logits:
        assert len(got_logits[rid]) == len(want_logits[rid]) > 0
        got_tokens = [int(row.argmax()) for row in got_logits[rid]]
        assert got_tokens == [int(row.argmax()) for row in want_logits[rid]], f"request {rid}"
        for step, (g, e) in enumerate(zip(got_logits[rid], want_logits[rid])):
            assert rel_err(g, e) <= tolerance, f"request {rid} step {step}"

"""CUDA graphs for decode steps, one per batch-size bucket (issue 9: the decode step is host-bound).

A decode step at the seed shape launches ~1,550 kernels; replaying them from a captured graph
costs one launch. Shapes inside a graph are fixed, so every decode step is padded to the smallest
bucket that holds it:

    bucket  = bucket_for(len(batch), buckets)        # 1, 2, 4, 8, 16, 32, ... 128, 192, ... max_batch
    inputs  = decode_inputs(batch, ...)              # host tensors padded to the bucket (pure)
    static  <- inputs                                # copies into the graph's input buffers
    graph.replay()                                   # captured lazily on a bucket's first use
    out     = DecodeOutput(static_logits[:len(batch)], (static_tokens[:len(batch)], static_shown[:len(batch)]))

The graph ends with the greedy pick (`kernels/sampling/greedy.py`: each row's argmax and whether it is
finite, one read of the lm_head's logits, left in the model's dtype), so a batch of greedy
requests without logprobs reads its tokens straight from the graph; any other batch samples
outside it, from the logits (sampling.sample_on_device converts them to float32 there).

Steps where prompt chunks join the decodes (or run alone) replay the same graphs: every token is
a row of one query (`rows_graphable`), a chunk's token at position p attending to its sequence's
first p + 1 keys; the chunk's keys are written before the attention reads them, so that is the
causal mask. Buckets past `max_batch` (up to `max_rows`, the scheduler's token budget beside
decodes) hold such steps; their graphs compute the logits of at most `max_batch` rows, those of the
sequences that sample (`logits_rows`, filled each step). Without this a step in which one prompt
joined 63 decodes ran eagerly, op by op from Python: ~30-50 ms on an H200 against ~6.6 ms for the
decode step (docs/benchmarks.md, "The served path").

Padding rows have token 0, position 0, context 0 (the paged kernel reads nothing for them), no
adapter (slot -1), and write their K/V into the *sink*: one KV block past the block manager's
blocks, never handed out and never read, so padding cannot touch a real sequence's cache.

Inside a graph nothing may depend on the step's host values: block tables are as wide as the
model's context (`ceil(max_model_len / block_size)`), the LoRA metadata is built for the bucket's
T with k = max_loras_per_request and max_slots = max_loras, and every LoRA op launches even when
no token has an adapter (whether a token has one, and each slot's rank, is data on the device, so
adapters entering and leaving slots need no re-capture). A step without adapters has its own
graph (no LoRA launches at all); steps with adapters are keyed by a *chunk class* as well: the
LoRA kernels pick their launch configuration (split K, columns per program) from
the number of active chunks on the host, and a graph keeps the one it was captured with, so each
class (up to 4, 16, 64, ... active chunks) is captured with the class's bound as its count. The
third key is the *rank class* (16, 32, 64, ... up to max_lora_rank; from 8 with one-pair chunks) bounding the largest true rank
among the step's slots: the kernels' rank tiles are captured that wide (LoraMeta.rank_bound). The
fourth is whether the step has *one-pair chunks* (LoraMeta.one_pair_chunks: many chunks of about
one token each), for which the shrink runs a row at a time; the class does not tell (32 chunks of
two tokens and 64 of one share class 64), so the step's own counts decide.

On CPU (tests) nothing is captured: `capture=False` runs the model eagerly on the same static
buffers, which checks the padding, the sink and the buffer fills against the eager path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from lorafleet.kernels.lora.meta import LoraMeta, build_lora_meta
from lorafleet.kernels.sampling.greedy import greedy_pick
from lorafleet.worker.engine.graph_inputs import DecodeInputs, decode_inputs, is_graphable, rows_graphable
from lorafleet.worker.engine.scheduler import ScheduledBatch
from lorafleet.worker.layers.attention import AttentionMetadata
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.sampling.sampler import GreedyPick

__all__ = ["DecodeGraphs", "DecodeInputs", "DecodeOutput", "decode_inputs", "is_graphable", "rows_graphable"]

log = logging.getLogger("lorafleet.cuda_graphs")

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
DENSE_BUCKETS_UP_TO = 128
# Decode buckets past DENSE_BUCKETS_UP_TO, and buckets past max_batch (prompt chunks beside the
# decodes), are coarser: a padding row costs little in a step of that many rows (the GEMMs are still
# memory-bound; padding rows read no KV), and every bucket is one more capture at start-up.
MIXED_BUCKET_STEP = 64


def graph_buckets(max_batch: int, max_rows: int | None = None) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to 128 and of 64 above it below `max_batch`, then
    `max_batch` itself; with `max_rows` above it (steps whose prompt chunks join the decodes), every
    `max_batch` + a multiple of MIXED_BUCKET_STEP below `max_rows`, then `max_rows`. The engine keeps
    both at most `EngineConfig.max_graph_tokens` (vLLM's largest capture size, 512): larger decode
    steps run eagerly, as in vLLM, so start-up captures a bounded number of graphs."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in SMALL_BUCKETS if b < max_batch}
    sizes |= set(range(BUCKET_STEP, min(max_batch, DENSE_BUCKETS_UP_TO + 1), BUCKET_STEP))
    sizes |= set(range(DENSE_BUCKETS_UP_TO + MIXED_BUCKET_STEP, max_batch, MIXED_BUCKET_STEP))
    if max_rows is not None and max_rows > max_batch:
        sizes |= set(range(max_batch + MIXED_BUCKET_STEP, max_rows, MIXED_BUCKET_STEP)) | {max_rows}
    return sorted(sizes | {max_batch})


def graph_sizes(max_num_seqs: int, max_num_batched_tokens: int, max_graph_tokens: int) -> tuple[int, int]:
    """(max_batch, max_rows) of the decode graphs: the most sequences and the most rows a graph takes,
    both at most `max_graph_tokens` (vLLM's max_cudagraph_capture_size, min(2 x max_num_seqs, 512,
    max_num_batched_tokens)): a step with more runs eagerly, so a max_num_seqs of 1024 (vLLM's on an
    H100) captures no more graphs, and holds no larger static buffers, than one of 512."""
    max_batch = min(max_num_seqs, max_graph_tokens, max_num_batched_tokens)
    return max_batch, max(max_batch, min(max_graph_tokens, max_num_batched_tokens))


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `batch_size` sequences; None when it is larger than all of them."""
    for b in buckets:
        if b >= batch_size:
            return b
    return None


def chunk_class(num_chunks: int, max_chunks: int) -> int:
    """0 for a step without adapters, else the power of 4 bounding its active LoRA chunks (<= max)."""
    if num_chunks <= 0:
        return 0
    cls = 1
    while cls < num_chunks:
        cls *= 4
    return min(cls, max_chunks)


def rank_class(bound: int, r_max: int, one_pair: bool = True) -> int:
    """The rank bound a graph is captured for: 8, 16, 32, 64, ... bounding `bound`, at most r_max.

    Class 8 only for steps of one-pair chunks, whose row-at-a-time modes then take 8-row tiles
    (rank-8 adapters, common, in a pool of higher max_lora_rank get them inside graphs too); the
    `tl.dot` modes' tiles are 16 wide at least, so other steps start at 16 (class 8 would capture
    the same kernels again)."""
    cls = 8 if one_pair else 16
    while cls < bound:
        cls *= 2
    return min(cls, r_max)


# (batch bucket, LoRA chunk class, rank class, one-pair chunks): what a graph is captured for;
# (bucket, 0, 0, False) is a step without adapters.
GraphKey = tuple[int, int, int, bool]


@dataclass(slots=True)
class DecodeOutput:
    """A decode step's outputs, `[num_seqs]` rows; views of a graph's static buffers, valid until
    the next `DecodeGraphs.run` (every row is read, or copied, in stream order before that)."""

    logits: torch.Tensor  # [N, vocab] in the model's dtype, as the lm_head computed them
    # (tokens, shown), [N] int64 each (greedy.greedy_pick: each row's argmax, and the argmax or -1
    # where the row's logits are not finite); None: not picked in the graph
    greedy: GreedyPick | None

    def rows(self, n: int) -> DecodeOutput:
        return DecodeOutput(self.logits[:n], None if self.greedy is None else (self.greedy[0][:n], self.greedy[1][:n]))


@dataclass(slots=True)
class _Captured:
    bucket: int
    attn: AttentionMetadata  # views of the static buffers
    lora_meta: LoraMeta | None  # this graph's own device buffers; each step's meta is copied in
    graph: torch.cuda.CUDAGraph | None  # None when not capturing (CPU)
    out: DecodeOutput | None  # the graph's outputs, [bucket] rows


@dataclass(slots=True)
class GraphStats:
    captures: int = 0
    replays: int = 0  # decode steps run from a bucket's buffers (graph replays on CUDA)
    capture_s: float = 0.0


class DecodeGraphs:
    """Static input buffers and one captured forward per (bucket, chunk class)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        max_loras: int,
        max_loras_per_request: int,
        sink_slot: int,
        capture: bool,
        max_rows: int | None = None,
    ) -> None:
        """`max_rows` (default `max_batch`): the most tokens a graph step takes, prompt chunks and
        decodes together; at most `max_batch` sequences sample in one."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)  # table width: the longest context the model takes
        self.max_batch = max_batch
        self.buckets = graph_buckets(max_batch, max_rows)
        self.max_loras = max_loras
        self.k = max_loras_per_request
        self.sink_slot = sink_slot
        self.capture = capture
        self.enabled = True  # benchmarks flip this to time both modes on one engine
        # Benchmarks flip this too (then re-capture) to time the greedy pick against sampling's
        # torch passes over float32 logits: False leaves every batch to sampling.sample_on_device.
        self.pick_in_graph = True
        self.stats = GraphStats()
        dev = model.device
        top = self.buckets[-1]
        # Allocated once, outside any graph's pool; each bucket captures views of their first rows.
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)  # [top]
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((top,), sink_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(top, self.width, dtype=torch.int32, device=dev)  # [top, width]
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.logits_rows = torch.arange(top, dtype=torch.int64, device=dev)  # filled every step
        # (bucket, chunk class, rank class, one-pair chunks) -> graph
        self._graphs: dict[GraphKey, _Captured] = {}
        self._dora_graphs: dict[GraphKey, _Captured] = {}  # the same, with DoRA's epilogue
        self.last: _Captured | None = None  # the last step's graph (benchmarks time its replay alone)
        self._pool = None  # one memory pool shared by every bucket's graph (made at the first capture)

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Decode steps, and steps where prompt chunks join them (or run alone), up to the largest bucket."""
        return self.enabled and rows_graphable(batch, self.buckets[-1], self.max_batch)

    def logits_len(self, bucket: int) -> int:
        """The rows whose logits a bucket's graph computes: at most one per sequence that samples."""
        return min(bucket, self.max_batch)

    def run(self, batch: ScheduledBatch, slot_of: dict[str, int], input_ids: torch.Tensor | None = None) -> DecodeOutput:
        """Forward a batch from its bucket's graph -> the logits and greedy picks of its sequences
        that sample, in batch order (in a decode step, every sequence).

        `input_ids` (on the device), when given, replaces the host input tokens of the leading rows,
        one per sequence continuing from the step before: async scheduling feeds that step's sampled
        tokens before the host has read them (prompt chunks joining after them keep their host tokens).
        The outputs are views of the graph's output buffers: valid until the next `run`.
        """
        bucket = bucket_for(batch.num_tokens, self.buckets)  # the caller checked `can_run`
        assert bucket is not None
        inputs = decode_inputs(batch, slot_of, bucket, self.width, self.block_size, self.k, self.sink_slot,
                               self.logits_len(bucket))
        step_meta = None
        if self.model.lora is not None and inputs.has_adapters:
            step_meta = build_lora_meta(inputs.token_slots, inputs.token_scales, self.max_loras, "cpu")
        key = (bucket, 0, 0, False)
        if step_meta is not None:
            bound = self.model.lora.rank_bound(inputs.token_slots)
            key = (bucket, chunk_class(step_meta.num_chunks, step_meta.max_chunks),
                   rank_class(bound, self.model.lora.max_rank, step_meta.one_pair_chunks), step_meta.one_pair_chunks)
        # DoRA's epilogue is captured only while a DoRA adapter is resident (`LoraSlots.apply_dora`):
        # those graphs are kept apart, and a graph without it is never replayed while one is.
        dora = step_meta is not None and self.model.lora.any_dora()
        return self.replay(key, dora, inputs, step_meta, input_ids)

    def replay(self, key: GraphKey, dora: bool, inputs: DecodeInputs, step_meta: LoraMeta | None,
               input_ids: torch.Tensor | None = None) -> DecodeOutput:
        """`run` once its graph is chosen: `key`'s graph (with DoRA's epilogue if `dora`), captured
        now if it is new, its buffers filled with `inputs` and `step_meta`, replayed. Tensor
        parallelism's ranks 1..N-1 call it with rank 0's choice (worker/engine/parallel.py)."""
        captured = (self._dora_graphs if dora else self._graphs).get(key)
        if captured is None:
            captured = self.capture_graph(key, dora)
        self._fill(captured, inputs, step_meta)
        if input_ids is not None:
            self.input_ids[: input_ids.shape[0]].copy_(input_ids, non_blocking=True)  # queued after the fill
        self.last = captured
        if captured.graph is not None:
            captured.graph.replay()
            out = captured.out
        else:
            out = self._forward(captured)
        self.stats.replays += 1
        assert out is not None
        return out.rows(inputs.num_sampled)

    def capture_base(self) -> int:
        """Capture the no-adapter graph of every bucket not captured yet (start-up warm-up; graphs with
        adapters, one per chunk class, rank class and one-pair flag, are captured on first use) ->
        graphs captured."""
        missing = [b for b in self.buckets if (b, 0, 0, False) not in self._graphs]
        for bucket in missing:
            self.capture_graph((bucket, 0, 0, False), False)
        return len(missing)

    def capture_graph(self, key: GraphKey, dora: bool) -> _Captured:
        """Capture `key`'s graph (among those with DoRA's epilogue if `dora`) and keep it."""
        captured = (self._dora_graphs if dora else self._graphs)[key] = self._capture(*key)
        return captured

    # -- internals -----------------------------------------------------------------------------
    def _fill(self, captured: _Captured, inputs: DecodeInputs, step_meta: LoraMeta | None) -> None:
        """Copy a step's inputs into the static buffers (queued on the stream, before the replay)."""
        b = captured.bucket
        for dst, src in (
            (self.input_ids, inputs.input_ids),
            (self.positions, inputs.positions),
            (self.slot_mapping, inputs.slot_mapping),
            (self.block_tables, inputs.block_tables),
            (self.context_lens, inputs.context_lens),
        ):
            dst[:b].copy_(src, non_blocking=True)
        assert inputs.logits_rows is not None
        self.logits_rows[: self.logits_len(b)].copy_(inputs.logits_rows, non_blocking=True)
        if captured.lora_meta is not None:
            assert step_meta is not None
            captured.lora_meta.copy_(step_meta)

    def _pad(self, bucket: int) -> None:
        """Every row a padding row: what the warm-up and capture run on (their K/V go to the sink)."""
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(self.sink_slot)
        self.block_tables[:bucket].zero_()
        self.context_lens[:bucket].zero_()
        self.logits_rows[:bucket].copy_(torch.arange(bucket, device=self.logits_rows.device))

    def _forward(self, captured: _Captured) -> DecodeOutput:
        b = captured.bucket
        logits = self.model.forward(
            self.input_ids[:b], self.positions[:b], captured.attn, self.kv_caches, captured.lora_meta,
            self.logits_rows[: self.logits_len(b)], graph=True, float_logits=not self.pick_in_graph,
        )
        return DecodeOutput(logits, greedy_pick(logits, self.model.attention_backend) if self.pick_in_graph else None)

    def _capture(self, bucket: int, cls: int, rank_cls: int, one_pair: bool) -> _Captured:
        attn = AttentionMetadata(
            query_lens=[1] * bucket,
            context_lens=[0] * bucket,  # host copies are not read in a graph (fixed_shapes)
            query_start=list(range(bucket + 1)),
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            context_lens_t=self.context_lens[:bucket],
            all_decode=True,
            fixed_shapes=True,
        )
        meta = None
        if cls:
            meta = build_lora_meta(
                torch.full((bucket, self.k), -1, dtype=torch.int32),
                torch.zeros((bucket, self.k), dtype=torch.float32),
                self.max_loras,
                self.model.device,
            )
            meta.num_chunks = cls  # what the kernels pick their configuration for (module docstring)
            meta.launch_chunks = cls  # and their grids: a step of this class has at most cls chunks
            meta.rank_bound = rank_cls  # their rank tiles likewise
            meta.one_pair = one_pair  # and the shrink's mode: the step's chunks, not the class
        captured = _Captured(bucket=bucket, attn=attn, lora_meta=meta, graph=None, out=None)
        if not self.capture:
            return captured
        t0 = time.perf_counter()
        self._pad(bucket)
        dev = self.model.device
        with torch.cuda.device(dev):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # Warm-up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._forward(captured)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server pins adapter weights in another thread while a bucket captures.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                captured.out = self._forward(captured)
        captured.graph = graph
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        log.info("captured the decode graph for batch bucket %d, LoRA chunk class %d, rank class %d%s in %.2f s",
                 bucket, cls, rank_cls, ", one-pair chunks" if one_pair else "", time.perf_counter() - t0)
        return captured

"""A graph step's host inputs: which batches the graphs run, and their rows padded to a bucket.

Decode steps are a row per sequence; steps where prompt chunks join them are a row per token, each
of one query over its sequence's context up to it (worker/engine/cuda_graphs.py says why that is
the causal mask). Pure: numpy and torch tensors on the host, no device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.worker.engine.scheduler import ScheduledBatch
from lorafleet.worker.engine.sequence import Sequence


def is_graphable(batch: ScheduledBatch) -> bool:
    """Every sequence decodes one token and samples it (a 1-token prefill chunk samples nothing):
    the steps async scheduling runs."""
    return bool(batch.seqs) and all(
        n == 1 and seq.num_computed + 1 == len(seq) for seq, n in zip(batch.seqs, batch.num_new_tokens)
    )


def rows_graphable(batch: ScheduledBatch, max_rows: int, max_sampled: int) -> bool:
    """A step whose tokens a graph can run as rows of one query each: decodes and prompt chunks
    (a chunk's token at position p attends to the sequence's first p + 1 keys, the chunk's own
    written before the attention reads them), at most `max_rows` tokens and `max_sampled`
    sequences sampling. Steps scoring prompt tokens (prompt_logprobs) need every row's logits: eager."""
    if not batch.seqs or batch.num_tokens > max_rows:
        return False
    sampled = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if n < 1 or seq.scores_prompt or seq.num_computed + n > len(seq):
            return False
        sampled += seq.num_computed + n == len(seq)
    return sampled <= max_sampled


def _token_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """`seq.tokens[start:start + n]` without copying the whole sequence."""
    p = len(seq.prompt_ids)
    if start + n <= p:
        return seq.prompt_ids[start : start + n]
    if start >= p:
        return seq.output_ids[start - p : start - p + n]
    return seq.prompt_ids[start:] + seq.output_ids[: start + n - p]


@dataclass(slots=True)
class DecodeInputs:
    """One step's inputs on the host, a row per token, padded to a bucket (rows past `num_rows` are
    padding); in a decode step rows and sequences are the same."""

    num_seqs: int
    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slot_mapping: torch.Tensor  # [bucket] int64; padding rows -> the sink slot
    block_tables: torch.Tensor  # [bucket, width] int32, padded with 0
    context_lens: torch.Tensor  # [bucket] int32; padding rows 0
    token_slots: torch.Tensor  # [bucket, k] int32; -1 = no adapter
    token_scales: torch.Tensor  # [bucket, k] float32
    num_rows: int = 0  # tokens of the step (0: num_seqs)
    # [logits_len] int64: the row of each sampling sequence's last token, in batch order, padded
    # with row 0 (whose logits are computed and dropped)
    logits_rows: torch.Tensor | None = None
    num_sampled: int = 0

    @property
    def has_adapters(self) -> bool:
        return bool((self.token_slots >= 0).any())


def _blank(bucket: int, width: int, k: int, sink_slot: int, logits_len: int) -> tuple[np.ndarray, ...]:
    """A step's host arrays, all padding: ids, positions, slots (the sink), tables, context lengths,
    token slots (-1), token scales, logits rows."""
    return (np.zeros(bucket, dtype=np.int64), np.zeros(bucket, dtype=np.int64),
            np.full(bucket, sink_slot, dtype=np.int64), np.zeros((bucket, width), dtype=np.int32),
            np.zeros(bucket, dtype=np.int32), np.full((bucket, k), -1, dtype=np.int32),
            np.zeros((bucket, k), dtype=np.float32), np.zeros(logits_len, dtype=np.int64))


def _inputs(num_seqs: int, num_rows: int, num_sampled: int, *arrays: np.ndarray) -> DecodeInputs:
    """`_blank`'s arrays, filled, as the step's DecodeInputs (tensors sharing their memory)."""
    ids, positions, slots, tables, ctx, token_slots, token_scales, logits_rows = map(torch.from_numpy, arrays)
    return DecodeInputs(num_seqs=num_seqs, input_ids=ids, positions=positions, slot_mapping=slots,
                        block_tables=tables, context_lens=ctx, token_slots=token_slots, token_scales=token_scales,
                        num_rows=num_rows, logits_rows=logits_rows, num_sampled=num_sampled)


def decode_inputs(
    batch: ScheduledBatch,
    slot_of: dict[str, int],
    bucket: int,
    width: int,
    block_size: int,
    k: int,
    sink_slot: int,
    logits_len: int | None = None,
) -> DecodeInputs:
    """The padded host inputs of a batch, a row per token; rows match `ModelRunner.prepare`'s.

    A sequence's rows start at position `seq.num_computed`. In a decode step that is `len(seq) - 1`
    (the newest token), or, for async scheduling's next step, `len(seq)`: the token there is still
    on the device and the row's host id is replaced (`DecodeGraphs.run(input_ids=...)`); the block
    table must hold it. A prompt chunk's rows are its tokens, each at its own position with the
    context up to it. `logits_len` (default `bucket`): the rows whose logits the step computes.
    """
    n_rows = batch.num_tokens
    if n_rows > bucket:
        raise ValueError(f"{n_rows} rows do not fit bucket {bucket}")
    logits_len = bucket if logits_len is None else logits_len
    ids, positions, slots, tables, ctx, token_slots, token_scales, logits_rows = _blank(bucket, width, k, sink_slot,
                                                                                       logits_len)
    row = sampled = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, total = seq.num_computed, len(seq)  # not `seq.tokens`, which copies; see above
        if len(seq.block_table) > width:
            raise ValueError(f"sequence {seq.seq_id} has {len(seq.block_table)} blocks, the graph's tables {width}")
        end = row + n
        if n == 1:  # a decode (or async scheduling's next step, whose token is replaced on the device)
            if start + 1 >= total:
                ids[row] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
            else:  # a one-token prompt chunk
                ids[row] = _token_ids(seq, start, 1)[0]
            positions[row] = start
            slots[row] = seq.block_table[start // block_size] * block_size + start % block_size
            ctx[row] = start + 1
            tables[row, : len(seq.block_table)] = seq.block_table
            for j, (name, scale) in enumerate(seq.adapters):
                token_slots[row, j] = slot_of[name]
                token_scales[row, j] = scale
        else:
            ids[row:end] = _token_ids(seq, start, n)
            pos = np.arange(start, start + n)
            positions[row:end] = pos
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots[row:end] = table[pos // block_size] * block_size + pos % block_size
            ctx[row:end] = pos + 1
            tables[row:end, : len(seq.block_table)] = seq.block_table
            for j, (name, scale) in enumerate(seq.adapters):
                token_slots[row:end, j] = slot_of[name]
                token_scales[row:end, j] = scale
        if start + n >= total:  # it samples: its last row's logits
            if sampled >= logits_len:
                raise ValueError(f"more than {logits_len} sequences sample in this step")
            logits_rows[sampled] = end - 1
            sampled += 1
        row = end
    return _inputs(len(batch.seqs), n_rows, sampled, ids, positions, slots, tables, ctx, token_slots, token_scales,
                   logits_rows)


@dataclass(slots=True)
class PackedInputs:
    """A graph step's `DecodeInputs` without their padding, for tensor parallelism's step broadcast
    (worker/engine/rank_graphs.py): what rank 0 sends the other ranks each graph step, from which they
    rebuild the same padded inputs (`unpack_inputs`). Rows that repeat a block table and adapters
    (a prompt chunk's tokens) are sent once, with their count; a row's context is its position + 1
    and its KV slot follows from its table, as `decode_inputs` makes them. numpy arrays: they pickle
    smaller than tensors."""

    num_seqs: int
    tokens: np.ndarray  # [2, rows] int32: each row's token id and position
    runs: np.ndarray | None  # [runs] int32: consecutive rows sharing a table and adapters; None: a run per row
    tables: np.ndarray  # [runs, used width] int32: each run's block table, past its last nonzero column cut
    adapters: np.ndarray  # [runs, k] int32: slots, -1 = none
    scales: np.ndarray  # [runs, k] float32
    logits_rows: np.ndarray  # [sampled] int32


def pack_inputs(inputs: DecodeInputs) -> PackedInputs:
    """`inputs` without their padding (`unpack_inputs` restores them exactly)."""
    n = inputs.num_rows or inputs.num_seqs
    tables = inputs.block_tables[:n].numpy()
    used = np.flatnonzero(tables.any(axis=0))
    tables = tables[:, : int(used[-1]) + 1 if used.size else 0]
    slots = inputs.token_slots[:n].numpy()
    scales = inputs.token_scales[:n].numpy()
    runs = None
    if n > inputs.num_seqs:  # a prompt chunk's rows repeat its table and adapters: once per run
        same = ((tables[1:] == tables[:-1]).all(axis=1) & (slots[1:] == slots[:-1]).all(axis=1)
                & (scales[1:] == scales[:-1]).all(axis=1))
        starts = np.flatnonzero(np.concatenate(([True], ~same)))
        runs = np.diff(np.append(starts, n)).astype(np.int32)
        tables, slots, scales = tables[starts], slots[starts], scales[starts]
    assert inputs.logits_rows is not None
    return PackedInputs(
        num_seqs=inputs.num_seqs,
        tokens=np.stack([inputs.input_ids[:n].numpy(), inputs.positions[:n].numpy()]).astype(np.int32),
        runs=runs,
        tables=tables,
        adapters=slots,
        scales=scales,
        logits_rows=inputs.logits_rows[: inputs.num_sampled].numpy().astype(np.int32),
    )


def unpack_inputs(packed: PackedInputs, bucket: int, width: int, block_size: int, k: int, sink_slot: int,
                  logits_len: int) -> DecodeInputs:
    """The padded inputs `decode_inputs` made for the packed step (the same bucket, width, k, sink
    and logits rows as rank 0's graphs)."""
    n = packed.tokens.shape[1]
    ids, positions, slots, tables, ctx, token_slots, token_scales, logits_rows = _blank(bucket, width, k, sink_slot,
                                                                                       logits_len)
    ids[:n] = packed.tokens[0]
    pos = packed.tokens[1].astype(np.int64)
    positions[:n] = pos
    ctx[:n] = pos + 1
    runs = packed.runs
    tables[:n, : packed.tables.shape[1]] = packed.tables if runs is None else np.repeat(packed.tables, runs, axis=0)
    slots[:n] = tables[np.arange(n), pos // block_size].astype(np.int64) * block_size + pos % block_size
    token_slots[:n] = packed.adapters if runs is None else np.repeat(packed.adapters, runs, axis=0)
    token_scales[:n] = packed.scales if runs is None else np.repeat(packed.scales, runs, axis=0)
    sampled = packed.logits_rows.shape[0]
    logits_rows[:sampled] = packed.logits_rows
    return _inputs(packed.num_seqs, n, sampled, ids, positions, slots, tables, ctx, token_slots, token_scales,
                   logits_rows)

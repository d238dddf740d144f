"""Runs a scheduled batch on the model: builds the step's tensors once, then forward and sample."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lorafleet.kernels.lora.meta import LoraMeta, build_lora_meta
from lorafleet.worker.engine.cuda_graphs import DecodeGraphs, DecodeOutput
from lorafleet.worker.engine.scheduler import ScheduledBatch
from lorafleet.worker.engine.sequence import SamplingParams, Sequence
from lorafleet.worker.layers.attention import AttentionMetadata
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.sampling.logits_processors import LogitsProcessors
from lorafleet.worker.sampling.sampler import SampledTokens, TokenLogprobs, sample_on_device

# Called with a step's sampled sequences and their float32 logits `[N, vocab]`, before sampling:
# edits in place change what is sampled (tests poison rows with it). Turns async scheduling off.
LogitsHook = Callable[[list[Sequence], torch.Tensor], None]

# The sampling of a row whose request has finished since its step was launched (async scheduling
# samples some steps only after reading the one before: AsyncStepper): the row is discarded on reading.
DISCARDED_ROW = SamplingParams(max_tokens=1, temperature=0.0)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, max_loras: int, max_loras_per_request: int,
                 max_num_seqs: int = 256) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.max_loras = max_loras
        self.k = max_loras_per_request
        c = model.config
        # One block more than the block manager hands out: the sink, where padding rows of a CUDA
        # graph bucket write their K/V (never read, never part of a sequence).
        self.sink_slot = num_blocks * block_size
        shape = (num_blocks + 1, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=self.device), torch.zeros(shape, dtype=model.dtype, device=self.device))
            for _ in range(c.num_layers)
        ]
        self._generators: dict[int, torch.Generator] = {}
        self.logits_processors = LogitsProcessors(c.vocab_size, self.device, max_rows=max_num_seqs)
        self.graphs: DecodeGraphs | None = None  # set by the engine when EngineConfig.cuda_graphs is on
        # Forwards run so far, and the last one's (path, tokens): "graph" (replayed from the decode
        # graphs' buffers) or "eager" (op by op). The server's per-step metrics read them.
        self.forwards = 0
        self.last_forward: tuple[str, int] = ("eager", 0)

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        c = model.config
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8

    def generator_for(self, seq: Sequence) -> torch.Generator | None:
        # Only seeded requests own a generator; the others draw from sampling's shared one, in one call.
        if seq.sampling.greedy or seq.sampling.seed is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.sampling.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self.logits_processors.forget(seq)

    def prepare(self, batch: ScheduledBatch, slot_of: dict[str, int]) -> tuple:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        logits_rows: list[int] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []  # (seq, its row in the step, the prompt token it predicts)
        token_slots: list[list[int]] = []
        token_scales: list[list[float]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed
            ids.extend(seq.tokens[start : start + n])
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            context_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if start + n == len(seq):
                logits_rows.append(query_start[-1] - 1)
            if seq.sampling.prompt_logprobs is not None:  # positions whose next prompt token is not scored yet
                for pos in range(max(start, len(seq.prompt_lps)), min(start + n, len(seq.prompt_ids) - 1)):
                    prompt_rows.append((seq, query_start[-2] + pos - start, seq.prompt_ids[pos + 1]))
            entry_slots = [slot_of[name] for name, _ in seq.adapters] + [-1] * (self.k - len(seq.adapters))
            entry_scales = [scale for _, scale in seq.adapters] + [0.0] * (self.k - len(seq.adapters))
            token_slots.extend([entry_slots] * n)
            token_scales.extend([entry_scales] * n)

        dev = self.device
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = torch.zeros(len(batch.seqs), max_blocks, dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        attn = AttentionMetadata(
            query_lens=list(batch.num_new_tokens),
            context_lens=context_lens,
            query_start=query_start,
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32).to(dev, non_blocking=True),
            all_decode=all(n == 1 for n in batch.num_new_tokens),
        )
        lora_meta: LoraMeta | None = None
        if any(seq.adapters for seq in batch.seqs):
            slots_t = torch.tensor(token_slots, dtype=torch.int32)
            lora_meta = build_lora_meta(slots_t, torch.tensor(token_scales, dtype=torch.float32), self.max_loras, dev)
            lora_meta.launch_chunks = lora_meta.num_chunks  # an eager step: grids of its own chunks
            if self.model.lora is not None:  # rank tiles as wide as this step's largest true rank
                lora_meta.rank_bound = max(1, self.model.lora.rank_bound(slots_t))
        return (
            torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            attn,
            lora_meta,
            torch.tensor(logits_rows + [row for _, row, _ in prompt_rows], dtype=torch.int64).to(dev, non_blocking=True),
            [(seq, token) for seq, _, token in prompt_rows],
        )

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, slot_of: dict[str, int], sampled: list[Sequence], hook: LogitsHook | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Forward the batch; sample one token for each sequence in `sampled` (prefill done or decode)."""
        greedy = None
        graphed = self.graphs is not None and self.graphs.can_run(batch)
        self.forwards += 1
        self.last_forward = ("graph" if graphed else "eager", batch.num_tokens)
        if graphed:
            out = self.graphs.run(batch, slot_of)  # the sampling sequences' rows: they match `sampled`
            logits, greedy = out.logits, out.greedy
        else:
            input_ids, positions, attn, lora_meta, logits_rows, prompt_rows = self.prepare(batch, slot_of)
            logits = self.model.forward(input_ids, positions, attn, self.kv_caches, lora_meta, logits_rows)
            if prompt_rows:  # the rows after the sampled ones score prompt tokens
                _score_prompt(logits[len(logits) - len(prompt_rows):], prompt_rows)
                logits = logits[: len(logits) - len(prompt_rows)]
        if hook is not None:  # float32 logits the hook may edit in place: sampled from as edited
            logits, greedy = logits.float(), None
            hook(sampled, logits)
        if not sampled:
            return [], []
        return self._sample(logits, sampled, greedy).read()

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, slot_of: dict[str, int], input_ids: torch.Tensor | None = None
    ) -> SampledTokens:
        """An all-decode step from the graph path, left in flight (async scheduling): inputs copied,
        graph replayed, sampling queued and its host copy started; nothing is read on the host.

        `input_ids` (on the device, one per sequence) replaces the sequences' newest host tokens.
        """
        out = self.replay(batch, slot_of, input_ids)
        return self.sample_replayed(out, batch.seqs, pending=0 if input_ids is None else 1)

    @torch.inference_mode()
    def replay(self, batch: ScheduledBatch, slot_of: dict[str, int], input_ids: torch.Tensor | None = None) -> DecodeOutput:
        """`launch`'s forward alone: inputs copied, graph replayed, nothing sampled. Its outputs are
        the graph's buffers, valid until the next replay: `sample_replayed` them before it."""
        assert self.graphs is not None
        self.forwards += 1
        self.last_forward = ("graph", batch.num_tokens)
        return self.graphs.run(batch, slot_of, input_ids)

    @torch.inference_mode()
    def sample_replayed(self, out: DecodeOutput, seqs: list[Sequence], pending: int) -> SampledTokens:
        """`launch`'s sampling, queued behind the replay of `out`, its host copy started."""
        return self._sample(out.logits, seqs, out.greedy, pending).start_copy()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy, pending: int = 0) -> SampledTokens:
        """Queue the sampling of one token for each of `seqs` (rows of `logits`), their logit edits
        first. pending: tokens each has sampled that its host `output_ids` lack (see `prepare`).
        A finished sequence's row is sampled greedy, without edits or its generator (`DISCARDED_ROW`)."""
        params = [DISCARDED_ROW if s.finished else s.sampling for s in seqs]
        generators = [None if s.finished else self.generator_for(s) for s in seqs]
        edit = self.logits_processors.prepare(seqs, pending)
        return sample_on_device(logits, params, generators, greedy, edit)


SCORE_SLICE = 256  # prompt rows a log-softmax pass takes: its float32 temporaries stay ~2 KB x vocab


def _score_prompt(logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> None:
    """Append each row's prompt-token logprob (and its sequence's top k) to `seq.prompt_lps`, in
    order. A row whose logits are not finite scores null (JSON has no NaN)."""
    k_max = min(max(seq.sampling.prompt_logprobs for seq, _ in rows), logits.shape[1])
    for lo in range(0, len(rows), SCORE_SLICE):
        part = rows[lo : lo + SCORE_SLICE]
        logp = torch.log_softmax(logits[lo : lo + SCORE_SLICE].float(), dim=-1)
        targets = torch.tensor([token for _, token in part], dtype=torch.int64, device=logp.device)
        chosen_t = logp.gather(1, targets.unsqueeze(1))
        ranks = ((logp > chosen_t).sum(dim=-1) + 1).tolist()
        chosen = chosen_t.view(-1).tolist()
        top = logp.topk(k_max, dim=-1) if k_max else None
        top_values, top_ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        for i, (seq, token) in enumerate(part):
            k = seq.sampling.prompt_logprobs
            best = [(t, v) for t, v in zip(top_ids[i][:k], top_values[i][:k]) if math.isfinite(v)] if k else []
            finite = math.isfinite(chosen[i])
            seq.prompt_lps.append(TokenLogprobs(token_id=token, logprob=chosen[i] if finite else None, top=best,
                                                rank=ranks[i] if finite else None))

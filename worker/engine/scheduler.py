"""Continuous batching under a token budget, at most `max_loras` distinct adapters per batch (torch-free).

Each step: running requests first (oldest first; decodes and unfinished prefill chunks), then
waiting ones in arrival order (preempted first). A waiting request whose adapters would push the
batch past `max_loras` is *deferred* — skipped for this step and counted — without blocking
requests for adapters already in the batch or base-only requests. A request deferred for
`aging_steps` steps is *starving*: admission then stops for everything that would keep other
adapters in the batch, so they drain and the starving adapter gets a slot (base-only requests
still flow). When KV blocks run out, the newest running request is preempted by recompute.
While running requests decode, and they take at most half of `mixed_step_tokens` when it is set
(the decode graphs' rows, worker/engine/cuda_graphs.py), the step's budget is those rows, so prompts
joining the decodes are chunked to fit a graph; with more decodes the step takes the whole budget
(it runs eagerly when prompt chunks join), so waiting prompts are not starved of tokens.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    aging_steps: int = 32
    # The token budget of a step with a few decodes in it (None: max_num_batched_tokens): the engine
    # sets its graphs' row capacity, so such steps, prompt chunks included, replay a graph.
    mixed_step_tokens: int | None = None

    def budget(self, decoding: int) -> int:
        """A step's token budget; `decoding`: the running sequences that decode in it. The graphs' rows
        while the decodes leave at least half of them to prompt chunks, else the whole budget."""
        if 0 < decoding and self.mixed_step_tokens is not None and 2 * decoding <= self.mixed_step_tokens:
            return min(self.max_num_batched_tokens, self.mixed_step_tokens)
        return self.max_num_batched_tokens


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per seq, this step
    preempted: list[Sequence] = field(default_factory=list)
    deferred: list[Sequence] = field(default_factory=list)  # waiting for an adapter slot
    not_ready: list[Sequence] = field(default_factory=list)  # adapter still loading into memory

    @property
    def adapters(self) -> set[str]:
        return {name for seq in self.seqs for name in seq.adapter_names}

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        adapter_ready: Callable[[str], bool] = lambda _name: True,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.adapter_ready = adapter_ready
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.deferred_total = 0  # requests skipped for lack of an adapter slot (vLLM's "deferred")
        self.preempted_total = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, free: bool = True) -> None:
        """`free=False`: a step still in flight writes the sequence's K/V; the caller frees its
        blocks once that step is done (async scheduling)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        self.running.remove(seq)
        if free:
            self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_adapters(self) -> set[str]:
        return {name for seq in self.waiting for name in seq.adapter_names}

    def running_adapters(self) -> set[str]:
        return {name for seq in self.running for name in seq.adapter_names}

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.budget(sum(seq.num_uncomputed == 1 for seq in self.running))
        scoring = PROMPT_SCORING_CHUNK  # prompt tokens this step may score, over all its requests

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = chunk(seq, budget, scoring)
            if n == 0:  # a prompt to score, and this step's scoring is taken: next step
                i += 1
                continue
            while not self.blocks.allocate(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                scoring -= n if seq.scores_prompt else 0
                i += 1
                continue
            break  # seq itself was preempted: nothing after it can run either

        # 2. Waiting requests in order, under max_num_seqs, the token budget and max_loras.
        in_batch: Counter[str] = Counter(name for seq in self.running for name in seq.adapter_names)
        starving = self._starving_adapters()
        admitted: list[Sequence] = []
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) + len(admitted) >= cfg.max_num_seqs:
                break
            verdict = self._verdict(seq, in_batch, starving)
            if verdict is not None:
                (batch.not_ready if verdict == "not_ready" else batch.deferred).append(seq)
                continue
            n = chunk(seq, budget, scoring)
            if n == 0:
                continue
            names = seq.adapter_names
            hit = None if seq.block_table or seq.scores_prompt else self.blocks.match_prefix(seq)
            n = chunk(seq, budget, scoring)  # after a prefix hit, fewer tokens are left
            if not self.blocks.allocate(seq, seq.num_computed + n):
                self.blocks.free(seq)
                seq.num_computed = 0
                # Out of KV blocks: stop here rather than let smaller requests behind overtake it, so
                # a long request is not starved of memory by a stream of short ones (FCFS for KV).
                break
            if hit is not None:
                self.blocks.record_lookup(len(seq), hit)
            in_batch.update(names)
            admitted.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            scoring -= n if seq.scores_prompt else 0
        for seq in admitted:
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            seq.deferred_steps = 0
            self.running.append(seq)
        for seq in batch.deferred:
            seq.deferred_steps += 1
        self.deferred_total += len(batch.deferred)
        return batch

    def _verdict(self, seq: Sequence, in_batch: Counter[str], starving: set[str]) -> str | None:
        """Why a waiting request cannot join now ("not_ready", "deferred"), else None."""
        names = seq.adapter_names
        if not all(self.adapter_ready(name) for name in names):
            return "not_ready"
        new = names - in_batch.keys()
        if len(in_batch) + len(new) > self.config.max_loras or (starving and names and not names <= starving):
            return "deferred"
        return None

    def hold_admission(self, decoding: list[Sequence], free_blocks: int) -> bool:
        """True when `schedule()` would admit no waiting request (async scheduling skips it then).

        A dry run of `schedule()`'s admission with `decoding` as the running batch (one token each)
        and `free_blocks` left after their blocks. When it holds, the deferred requests are counted
        as `schedule()` counts them, so aging advances while steps skip the scheduler.
        """
        cfg = self.config
        budget = cfg.budget(len(decoding)) - len(decoding)
        in_batch: Counter[str] = Counter(name for seq in decoding for name in seq.adapter_names)
        starving = self._starving_adapters()
        deferred = []
        for seq in self.waiting:
            if budget <= 0 or len(decoding) >= cfg.max_num_seqs:
                break
            verdict = self._verdict(seq, in_batch, starving)
            if verdict == "deferred":
                deferred.append(seq)
            if verdict is not None:
                continue
            if self.blocks.admission_cost(seq, chunk(seq, budget, PROMPT_SCORING_CHUNK, uncomputed=False)) <= free_blocks:
                return False
            break  # out of KV blocks: FCFS, as in schedule()
        for seq in deferred:
            seq.deferred_steps += 1
        self.deferred_total += len(deferred)
        return True

    def admit_beside(self, decoding: list[Sequence], in_flight: set[int], max_rows: int, max_sampled: int,
                     joins: Callable[[Sequence], bool]) -> tuple[ScheduledBatch, bool]:
        """`schedule()` for a step launched beside `decoding`: running sequences whose next input
        token is still on the device (one row each, their blocks allocated; async scheduling).

        Its other rows, in `schedule()`'s order under its token budget, max_num_seqs and max_loras:
        running sequences not in `in_flight` (prompt chunks left, or a decode left out of the step
        before), then waiting requests. At most `max_rows` rows in all and `max_sampled` sequences
        sampling (the graphs' limits); nothing is preempted. Returns those rows (blocks allocated,
        prompt tokens not yet counted as computed, admitted requests moved to running) and whether
        the scan stopped at a sequence `schedule()` would take but this step cannot: `joins`
        refused it, its blocks need a preemption, or the graphs' limits are reached first. The
        caller runs that sequence in a synchronous step once no other row joins (no starvation).
        max_num_seqs counts every running sequence, those ending in the step in flight included,
        so a slot freed by that step is taken one step later.
        """
        cfg = self.config
        batch = ScheduledBatch()
        others = [seq for seq in self.running if seq.seq_id not in in_flight]
        if not others and not self.waiting:  # steady-state decode: nothing joins
            return batch, False
        budget = cfg.budget(len(decoding) + sum(seq.num_uncomputed == 1 for seq in others)) - len(decoding)
        rows, sampling = max_rows - len(decoding), len(decoding)
        blocked = False

        def take(seq: Sequence, n: int) -> None:
            nonlocal budget, rows, sampling
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            rows -= n
            sampling += seq.num_computed + n == len(seq)

        for seq in others:  # 1. running sequences (schedule()'s step 1, without preemption)
            if budget <= 0:
                break
            n = chunk(seq, budget, PROMPT_SCORING_CHUNK)
            if n == 0:
                continue
            samples = seq.num_computed + min(n, rows) == len(seq)
            if not joins(seq) or rows <= 0 or (samples and sampling >= max_sampled) \
                    or not self.blocks.allocate(seq, seq.num_computed + min(n, rows)):
                blocked = True
                break
            take(seq, min(n, rows))

        in_batch: Counter[str] = Counter(name for seq in decoding + others for name in seq.adapter_names)
        starving = self._starving_adapters()
        admitted: list[Sequence] = []
        for seq in [] if blocked else list(self.waiting):  # 2. waiting requests (schedule()'s step 2)
            if budget <= 0 or len(self.running) + len(admitted) >= cfg.max_num_seqs:
                break
            verdict = self._verdict(seq, in_batch, starving)
            if verdict is not None:
                (batch.not_ready if verdict == "not_ready" else batch.deferred).append(seq)
                continue
            n = chunk(seq, budget, PROMPT_SCORING_CHUNK)
            if n == 0:
                continue
            if self.blocks.admission_cost(seq, n) > self.blocks.num_free:
                break  # out of KV blocks: schedule() stops here too (FCFS)
            if not joins(seq) or rows <= 0:
                blocked = True
                break
            hit = None if seq.block_table else self.blocks.match_prefix(seq)
            n = min(chunk(seq, budget, PROMPT_SCORING_CHUNK), rows)  # after a prefix hit, fewer are left
            full = seq.num_computed + n == len(seq) and sampling >= max_sampled
            if full or not self.blocks.allocate(seq, seq.num_computed + n):
                self.blocks.free(seq)
                seq.num_computed = 0
                blocked = blocked or full  # out of KV blocks: FCFS, as in schedule()
                break
            if hit is not None:
                self.blocks.record_lookup(len(seq), hit)
            in_batch.update(seq.adapter_names)
            admitted.append(seq)
            take(seq, n)
        for seq in admitted:
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            seq.deferred_steps = 0
            self.running.append(seq)
        if batch or not blocked:  # the step runs: deferrals count (else schedule() counts them)
            for seq in batch.deferred:
                seq.deferred_steps += 1
            self.deferred_total += len(batch.deferred)
        return batch, blocked

    def _starving_adapters(self) -> set[str]:
        """Adapters of waiting requests deferred for too long (empty when none starve)."""
        limit = self.config.aging_steps
        for seq in self.waiting:  # the oldest starving request wins; others wait their turn
            if seq.deferred_steps >= limit and seq.adapter_names:
                return set(seq.adapter_names)
        return set()

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free a running request's blocks; it re-queues first and recomputes prompt + output so far."""
        self.running.remove(seq)
        if seq in batch.seqs:
            idx = batch.seqs.index(seq)
            del batch.seqs[idx]
            del batch.num_new_tokens[idx]
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.preempted_total += 1

    def postprocess(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance computed counts after the step; returns the sequences that produce a token now."""
        sampled = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed += n
            self.blocks.register_full_blocks(seq)
            if seq.num_uncomputed == 0:
                sampled.append(seq)
        return sampled


# Requests scoring their prompts (SamplingParams.prompt_logprobs) compute this many prompt tokens a
# step at most, all together: each one's logits over the whole vocabulary are kept for the scoring
# (512 rows at a 100k vocabulary: 205 MB in float32, and the memory plan keeps room for them),
# where the token budget alone would allow max_num_batched_tokens.
PROMPT_SCORING_CHUNK = 512


def chunk(seq: Sequence, budget: int, scoring: int, uncomputed: bool = True) -> int:
    """The tokens `seq` computes this step under `budget`, and under `scoring` if it scores its
    prompt (of its uncomputed ones, or, for `BlockManager.admission_cost`, the budget it may take)."""
    n = min(seq.num_uncomputed, budget) if uncomputed else budget
    return min(n, scoring) if seq.scores_prompt else n

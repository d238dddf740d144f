"""Async scheduling (`EngineConfig.async_scheduling`, `--async-scheduling`): the next decode step
is launched before the previous one's tokens are read, so the host's bookkeeping runs while the
GPU computes.

The synchronous step is strictly sequential: schedule, launch, wait for the sampled tokens, then
stop checks, detokenization and outputs while the GPU idles (1.2 ms of a 6.4 ms base-only step at
batch 64 on the H200). In steady-state decode none of that host work decides the next step's
*shape*: every running sequence decodes one more token, at a position the host knows, into a KV
block it can allocate already. Only the token *value* is unknown, and it is on the device. So:

    step n   launched: inputs copied, graph replayed, sampling queued, its tokens copied
             device -> pinned host behind a CUDA event (on CPU simply computed); nothing read
    step n+1 launched: the same sequences (minus those that certainly end at step n by
             max_tokens / max_model_len), positions / slot mapping / context lengths / block
             tables advanced on the host (KV blocks allocated as usual), each row's input token
             gathered ON THE DEVICE from step n's sampled tokens into the graph's input buffer
    step n   read: tokens appended, stop tokens / strings, detokenization, logprobs, outputs,
             while the GPU runs step n+1; the sequences' `num_computed` then takes step n+1's
             token, and only now (the token is real) are their full blocks hashed for the prefix
             cache

`LLMEngine.step()` then returns step n's outputs in the call that launched step n+1: the same
outputs, in the same order per request, as the synchronous engine.

Some rows' next token depends on the host's view of the last one: a grammar's mask follows it
(structured outputs), and a bad word of several tokens is matched against the output's tail. A step
holding such a row is launched in two halves: step n+1's graph is replayed from step n's device
tokens as above, step n is read (the matchers take its tokens, the tails are known), and only then
is step n+1's sampling queued behind the replay, while the GPU still runs it. The host's mask work
overlaps the forward pass instead of the GPU waiting for it (docs/benchmarks.md, "Requests that
need the host's tokens"). A row whose
request ended on reading step n is then sampled greedy and unedited, and discarded as below.
`defer_sampling` off restores the synchronous fallback (benchmarks compare the two).

Prompt chunks join such a step too (`EngineConfig.async_admission`): step n+1 is the continuing
decodes (their input tokens gathered on the device, the leading rows) followed by rows whose tokens
the host knows: running prompts with tokens left, then waiting requests admitted in `schedule()`'s
order under its budget (`Scheduler.admit_beside`; a prompt chunk is a row per token in the decode
graphs). Their tokens are counted as computed at launch; a chunk that completes its prompt samples
the request's first token in step n+1 like any row, and is continued from the device from step
n+2. Admission is decided from what the host knows: a slot that frees up only by a stop token read
at step n is taken one step later. A joining row's sampling is queued only after step n is read
(as for grammars) when its edits count its outputs (min_tokens: it has no token in flight, the
decodes one each).

Only steps from the graph path run this way. A step is *entered* when the scheduler hands out an
all-decode batch the graphs can run (async on, graphs enabled, no logits hook); a step in flight is
*continued* only while nothing else needs a synchronous step:

- the next step's KV blocks for the continuing decodes fit without preemption;
- at least one sequence continues, at most the largest graph bucket;
- every row that `schedule()` would add can join (`AsyncStepper._joins`): its adapters are in GPU
  slots already (waiting requests' adapters are prefetched into free or unused slots first, never
  one the step in flight uses), it scores no prompt tokens, its blocks fit without preemption, and
  the graphs' rows and sampled sequences are not exceeded. A refused row stops the scan (FCFS);
  once no row joins before it, the step in flight is drained and it runs synchronously.

With `async_admission` off, a step in flight is continued only while every running request is in
it and no waiting request could be admitted (`Scheduler.hold_admission`, a dry run of
`schedule()`'s admission that also counts deferrals, so aging advances).

Otherwise the step in flight is read (drained) and the synchronous step runs, in the same call:
prefill and mixed steps the graphs cannot run, preemption, adapters needing a slot load, non-graph
devices.

A sequence that ends at step n by a stop token, a stop string or an error token (-1) was computed
in step n+1 as well: that row is discarded, and its KV blocks are freed only once step n+1 has
been read (so no block it writes is handed out meanwhile). An abort while a step is in flight is
treated the same way. Seeded requests draw once per step they are in, as in the synchronous
engine; a discarded row's extra draw goes to a generator that is dropped with its request.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.cuda_graphs import DecodeOutput, is_graphable
from lorafleet.worker.engine.model_runner import LogitsHook, ModelRunner
from lorafleet.worker.engine.outputs import RequestOutput
from lorafleet.worker.engine.scheduler import ScheduledBatch, Scheduler
from lorafleet.worker.engine.sequence import Sequence
from lorafleet.worker.lora.registry import AdapterRegistry
from lorafleet.worker.sampling.sampler import SampledTokens, TokenLogprobs


class SteppedEngine(Protocol):
    """What the stepper uses of `LLMEngine` (engine.py), which owns it."""

    runner: ModelRunner
    scheduler: Scheduler
    blocks: BlockManager
    registry: AdapterRegistry
    logits_hook: LogitsHook | None
    steps: int
    max_model_len: int
    config: EngineConfig

    def _append(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> RequestOutput: ...

    def _next_adapters(self, exclude: set[str]) -> list[str]: ...

log = logging.getLogger("lorafleet.async_step")


@dataclass(slots=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    number: int  # the engine's step count when it was launched
    seqs: list[Sequence]  # its rows, in order
    sampled: SampledTokens | None  # None until a deferred step is sampled (`replayed` then holds its forward)
    adapters: frozenset[str]
    replayed: DecodeOutput | None = None
    fed: int = 0  # leading rows whose input token was the step before's: computed once that is read
    silent: tuple[Sequence, ...] = ()  # its rows that sample nothing (prompt chunks short of the end)
    ids: frozenset[int] = frozenset()  # seq_ids of all its rows

    def __post_init__(self) -> None:
        self.ids = frozenset(seq.seq_id for seq in (*self.seqs, *self.silent))


@dataclass(slots=True)
class AsyncStats:
    launched: int = 0  # steps launched through this path
    overlapped: int = 0  # of those, launched while the previous step's tokens were still unread
    deferred: int = 0  # of the overlapped, sampled only once the step before was read (rows needing its tokens)
    discarded: int = 0  # rows read for requests that had ended (or were aborted) meanwhile
    joined: int = 0  # of the overlapped, steps with rows from the host (prompt chunks, admitted requests)
    admitted: int = 0  # waiting requests admitted by those steps
    fallbacks: Counter[str] = field(default_factory=Counter)  # why a step in flight was drained


class AsyncStepper:
    """The engine's step in flight and the finished sequences whose blocks it still writes."""

    def __init__(self, engine: SteppedEngine, enabled: bool) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self._zombies: list[Sequence] = []  # finished while in flight: blocks freed after it is read
        self.stats = AsyncStats()
        # EngineConfig.async_scheduling, resolved by the engine; benchmarks flip it between
        # workloads (the engine idle) to time both ways on one engine, as with DecodeGraphs.enabled.
        self.enabled = enabled
        # Steps with rows that need the host's tokens (grammars, multi-token bad words): sampled
        # after the step before is read (module docstring); off, such batches run synchronously.
        self.defer_sampling = True
        # EngineConfig.async_admission: prompt chunks (admitted requests, or running prompts with
        # tokens left) join the decodes of a step launched before the one in flight is read; off,
        # a step where any would join drains the one in flight and runs synchronously.
        self.admission = engine.config.async_admission
        # Tests: called with ("launch" | "read", step number) as steps are launched and read.
        self.on_event: Callable[[str, int], None] | None = None

    # -- entry points (LLMEngine.step) -----------------------------------------------------------
    def eligible(self, batch: ScheduledBatch) -> bool:
        """Whether a scheduled batch starts (or restarts) the async path."""
        graphs = self.engine.runner.graphs
        return (self._enabled() and graphs is not None and is_graphable(batch) and graphs.can_run(batch)
                and (self.defer_sampling or not any(seq.needs_host_tokens for seq in batch.seqs)))

    def enter(self, batch: ScheduledBatch, slot_of: dict[str, int]) -> list[RequestOutput]:
        """Launch a scheduled all-decode batch from the host's tokens, then continue from it."""
        engine = self.engine
        self.inflight = self._launched(batch.seqs, engine.runner.launch(batch, slot_of), batch.adapters)
        engine.scheduler.postprocess(batch)  # its tokens are all known: hashing sees real tokens
        return self.advance()

    def advance(self) -> list[RequestOutput]:
        """Launch the next step if nothing needs the scheduler, then read the step in flight."""
        step, self.inflight = self.inflight, None  # taken: a failure below does not read it twice
        assert step is not None
        try:
            self.inflight = self._launch_next(step)
            outputs = self._read(step)
            self._sample_deferred(self.inflight)
            self._commit(self.inflight)
        except BaseException:
            self.inflight = None  # the caller fails these requests (async_engine aborts them)
            self._free_zombies()
            raise
        self._free_zombies()
        self._prefetch(self.inflight.adapters if self.inflight is not None else frozenset())
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Read the step in flight without launching another (the engine is synchronous again)."""
        step, self.inflight = self.inflight, None
        outputs = self._read(step) if step is not None else []
        self._free_zombies()
        return outputs

    def holds(self, seq: Sequence) -> bool:
        """Whether the step in flight computes `seq` (so its blocks must outlive it)."""
        return self.inflight is not None and seq.seq_id in self.inflight.ids

    def free_later(self, seq: Sequence) -> None:
        self._zombies.append(seq)

    # -- the next step ---------------------------------------------------------------------------
    def _enabled(self) -> bool:
        graphs = self.engine.runner.graphs
        return (self.enabled and graphs is not None and graphs.enabled
                and self.engine.logits_hook is None)

    def _launch_next(self, step: InFlight) -> InFlight | None:
        rows = self._next_rows(step)
        if rows is None:
            return None
        engine = self.engine
        seqs = [step.seqs[i] for i in rows]
        for seq in seqs:
            ok = engine.blocks.allocate(seq, len(seq) + 1)  # the in-flight token's position
            assert ok, "checked by _next_rows"
        joined = ScheduledBatch()
        if self.admission:
            graphs = engine.runner.graphs
            assert graphs is not None
            self._prefetch(step.adapters)  # waiting requests' adapters into free slots: they can join
            running = len(engine.scheduler.running)
            joined, blocked = engine.scheduler.admit_beside(
                seqs, {seq.seq_id for seq in step.seqs}, graphs.buckets[-1], graphs.max_batch, self._joins)
            if blocked and not joined:
                self.stats.fallbacks["admission"] += 1
                return None
            self.stats.admitted += len(engine.scheduler.running) - running
        batch = ScheduledBatch(seqs + joined.seqs, [1] * len(seqs) + joined.num_new_tokens)
        names = batch.adapters
        # All resident (step n used them; `_joins` checked the joining rows'): nothing is loaded.
        slot_of = engine.registry.activate(sorted(names), names | step.adapters)
        assert step.sampled is not None
        feed = _gather(step.sampled.token_ids, rows)  # the leading rows' input tokens
        sampled = seqs + [s for s, n in zip(joined.seqs, joined.num_new_tokens) if s.num_computed + n == len(s)]
        silent = tuple(s for s, n in zip(joined.seqs, joined.num_new_tokens) if s.num_computed + n < len(s))
        self.stats.overlapped += 1
        self.stats.joined += bool(joined)
        runner = engine.runner
        if any(seq.needs_host_tokens for seq in seqs) or any(map(_needs_deferral, sampled[len(seqs):])):
            out = runner.replay(batch, slot_of, feed)  # sampled once `step` is read: _sample_deferred
            tokens = None
        elif joined:
            out, tokens = None, runner.sample_replayed(runner.replay(batch, slot_of, feed), sampled, pending=1)
        else:
            out, tokens = None, runner.launch(batch, slot_of, feed)
        engine.scheduler.postprocess(joined)  # prompt tokens, known on the host: computed (and hashable)
        return self._launched(sampled, tokens, names, out, len(seqs), silent)

    def _joins(self, seq: Sequence) -> bool:
        """Whether `seq` may join a step launched before the one in flight is read: its adapters are in
        GPU slots already (a slot load could evict one the step in flight reads), it scores no prompt
        tokens (the graphs compute the sampled rows' logits alone), and its sampling can wait for the
        step in flight to be read when its edits count its outputs (`_needs_deferral`)."""
        entries = self.engine.registry.entries
        resident = all(name in entries and entries[name].slot is not None for name in seq.adapter_names)
        return resident and not seq.scores_prompt and (self.defer_sampling or not _needs_deferral(seq))

    def _sample_deferred(self, step: InFlight | None) -> None:
        """Queue the sampling of a step launched as a replay alone, now that the step before is read:
        its rows' grammars have taken that step's tokens, and their outputs' tails are on the host."""
        if step is None or step.replayed is None:
            return
        step.sampled = self.engine.runner.sample_replayed(step.replayed, step.seqs, pending=0)
        step.replayed = None
        self.stats.deferred += 1

    def _next_rows(self, step: InFlight) -> list[int] | None:
        """The rows of `step` that the next step continues, or None (reason counted) to fall back."""
        engine = self.engine
        live = [i for i, seq in enumerate(step.seqs) if not seq.finished]
        rows = [i for i in live if not self._ends_at(step.seqs[i])]
        seqs = [step.seqs[i] for i in rows]
        reason = None
        if not self._enabled():
            reason = "disabled"
        elif not self.admission and len(live) != len(engine.scheduler.running):
            reason = "batch_changed"  # a running request is not in this step
        elif not seqs:
            reason = "all_end"  # every sequence ends at this step (max_tokens / max_model_len)
        elif not self.defer_sampling and any(seq.needs_host_tokens for seq in seqs):
            reason = "host_tokens"
        else:
            free = engine.blocks.num_free - sum(engine.blocks.blocks_needed(s, len(s) + 1) for s in seqs)
            if free < 0:
                reason = "preemption"
            elif not self.admission and not engine.scheduler.hold_admission(seqs, free):
                reason = "admission"
        if reason is not None:
            self.stats.fallbacks[reason] += 1
            return None
        return rows

    def _ends_at(self, seq: Sequence) -> bool:
        """The in-flight token is certainly the sequence's last (max_tokens / max_model_len)."""
        return len(seq.output_ids) + 1 >= seq.sampling.max_tokens or len(seq) + 1 >= self.engine.max_model_len

    def _launched(self, seqs: list[Sequence], sampled: SampledTokens | None, adapters,
                  replayed: DecodeOutput | None = None, fed: int = 0, silent: tuple[Sequence, ...] = ()) -> InFlight:
        engine = self.engine
        step = InFlight(engine.steps, seqs, sampled, frozenset(adapters), replayed, fed, silent)
        engine.steps += 1
        self.stats.launched += 1
        if self.on_event is not None:
            self.on_event("launch", step.number)
        return step

    # -- reading a step ----------------------------------------------------------------------------
    def _read(self, step: InFlight) -> list[RequestOutput]:
        assert step.sampled is not None, "a deferred step is sampled before it is read"
        tokens, logprobs = step.sampled.read()  # the one host sync
        if self.on_event is not None:
            self.on_event("read", step.number)
        append = self.engine._append
        outputs = []
        for seq, token, lp in zip(step.seqs, tokens, logprobs):
            if seq.finished:  # aborted while in flight, or ended at the step before (its extra row)
                self.stats.discarded += 1
            else:
                outputs.append(append(seq, token, lp))
        return outputs

    def _commit(self, step: InFlight | None) -> None:
        """The next step's input tokens are now on the host: count them as computed (and hashable)."""
        if step is None:
            return
        blocks = self.engine.blocks
        for seq in step.seqs[: step.fed]:
            if not seq.finished:
                seq.num_computed += 1
                blocks.register_full_blocks(seq)

    def _free_zombies(self) -> None:
        if not self._zombies:
            return
        keep = []
        for seq in self._zombies:
            if self.holds(seq):
                keep.append(seq)
            else:
                self.engine.blocks.free(seq)
        self._zombies = keep

    def _prefetch(self, in_flight: frozenset[str]) -> None:
        """Warm slots for waiting requests' adapters, never evicting one the step in flight uses."""
        engine = self.engine
        if not engine.scheduler.waiting:
            return
        running = engine.scheduler.running_adapters()
        protected = running | in_flight
        engine.registry.prefetch(engine._next_adapters(running), set(protected))


def _needs_deferral(seq: Sequence) -> bool:
    """A joining row sampled only once the step in flight is read: its edits read the host's tokens,
    or count its outputs for min_tokens (its step is sampled as if every row had a token in flight)."""
    return seq.needs_host_tokens or len(seq.output_ids) < seq.sampling.min_tokens


def _gather(tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`tokens[rows]` on the device: the rows' next input tokens (a slice when they are a prefix)."""
    if rows == list(range(len(rows))):
        return tokens[: len(rows)]
    index = torch.tensor(rows, dtype=torch.int64).to(tokens.device, non_blocking=True)
    return tokens.index_select(0, index)

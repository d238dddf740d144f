"""Per-request edits of a step's logits before sampling, in vLLM's order: `allowed_token_ids`, then
`min_tokens` (no stop token yet) and OpenAI's `logit_bias`, then the repetition, frequency and
presence penalties. (`min_p`, which only filters what is sampled, is a knob of `sampling`.)

    allowed:     logit = -inf for every token outside allowed_token_ids
    bad_words:   logit = -inf for a bad word's last token where the output ends with the rest of it
    min_tokens:  logit = -inf for EOS and stop_token_ids while fewer than min_tokens are generated
    bias:        logit += logit_bias[token]
    repetition:  for tokens in the prompt or the output, logit / p if logit > 0 else logit * p
    frequency:   logit -= frequency_penalty * (times the token is in the output)
    presence:    logit -= presence_penalty * (1 if the token is in the output)

A request that asks for any of them gets a row of device state from its first sampled token until
it ends (`forget`): a bias row (its logit_bias, -inf outside allowed_token_ids), its output tokens'
counts, and its prompt's tokens as a mask. A step takes the logits of its requests that edit (the
others are left alone, so the cost follows those requests), gathers their state with one index per
tensor, edits a copy (the logprobs stay the model's, vLLM's default), and once the tokens are drawn
adds each one to its request's counts on the device. So async scheduling, whose host has not yet seen the token in flight,
still penalises it at the next step, and no step copies token histories from the host. Steps
without such requests cost one check of their sampling params. The pass itself and the counting
are `lorafleet.kernels.sampling.logit_edits`: its Triton kernels on CUDA (`LORAFLEET_LOGIT_EDITS=torch`
takes the torch path there too), the torch path elsewhere. On the H200 the Triton pass took a
penalised batch's sampling from 1.5-1.6 ms to 0.64-0.72 ms a step (docs/benchmarks.md).

The state takes `BYTES_PER_ENTRY` (9) bytes a vocabulary entry per running request that uses it
(0.9 MB at a 100k vocabulary), allocated as such requests arrive (doubling, up to `max_num_seqs`
rows: a preempted request gives its row back and rebuilds it from its tokens when it resumes);
the memory plan keeps room for all of them (`memory_plan.plan_kv_blocks`).

Last, structured outputs' grammars (worker/sampling/structured.py) mask their rows: no state row, a bit
mask filled on the host from each request's matcher every step (`structured.MaskFiller`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial

import torch

from lorafleet.kernels.sampling.logit_edits import count_tokens, edit_logits
from lorafleet.worker import envs
from lorafleet.worker.engine.sequence import Sequence
from lorafleet.worker.engine.tokenizer import Tokenizer
from lorafleet.worker.sampling.structured import MaskFiller, apply_mask
from lorafleet.worker.sampling.structured import warm_up as warm_up_masks

# kernels.logit_edits' backend on CUDA (module docstring); elsewhere always the torch path.
CUDA_BACKEND = envs.LOGIT_EDITS
BYTES_PER_ENTRY = 4 + 4 + 1  # a row's bias (float32), count (int32) and prompt mask (bool) per token


def edits(seq: Sequence) -> bool:
    """Whether the request's logits are edited: min_tokens alone edits nothing without stop tokens."""
    sp = seq.sampling
    return sp.edits_logits and (sp.penalized or biased(seq) or bool(seq.bad_word_ids) or bool(seq.stop_ids))


def biased(seq: Sequence) -> bool:
    """Whether the request's bias row holds anything: logit_bias, allowed_token_ids, one-token bad words."""
    sp = seq.sampling
    return bool(sp.logit_bias) or sp.allowed_token_ids is not None or any(len(w) == 1 for w in seq.bad_word_ids)


class LogitsProcessors:
    """The device state of the requests that edit their logits, and each step's edit (`prepare`)."""

    def __init__(self, vocab: int, device: torch.device, backend: str | None = None, max_rows: int = 256) -> None:
        self.vocab = vocab
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.backend = backend or (CUDA_BACKEND if self.device.type == "cuda" else "torch")
        self.neg_inf = torch.tensor(float("-inf"), device=self.device)
        self._rows: dict[int, int] = {}  # seq_id -> its row
        self._free: list[int] = []
        self._capacity = 0
        self.bias = self.counts = self.in_prompt = torch.empty(0)
        self.masks = MaskFiller(vocab, self.device)  # the grammars' (worker/sampling/structured.py)
        self._grow(min(4, max_rows))

    def warm_up(self) -> None:
        """Run the edit and the counting once on scratch rows, so their kernels (Triton on CUDA:
        one compile each, whatever the edits) are ready before the first request that edits; and
        the grammars' mask (`structured.warm_up`)."""
        zeros = partial(torch.zeros, 1, self.vocab, device=self.device)
        plan = torch.tensor([0.0, 0.0, 1.1, 0.5, 0.5], device=self.device)  # row 0; repetition, frequency, presence
        counts = zeros(dtype=torch.int32)
        edit_logits(zeros(), plan, 1, zeros(), counts, zeros(dtype=torch.bool), every_row=True, biased=True,
                    penalized=True, repetition=True, backend=self.backend)
        count_tokens(counts, plan, 1, torch.zeros(1, dtype=torch.int64, device=self.device), every_row=True,
                     backend=self.backend)
        warm_up_masks(self.vocab, self.device)

    @property
    def rows_in_use(self) -> int:
        return len(self._rows)

    def prepare(self, seqs: list[Sequence], pending: int = 0) -> LogitsEdit | None:
        """This step's edit for its sampled rows `seqs` (None when none asks for one).

        pending: tokens each sequence has sampled that its host `output_ids` lack (1 for a step
        launched from the tokens of the step still in flight, async scheduling): they count towards
        min_tokens; their counts are on the device already. Grammars and multi-token bad words need
        it to be 0 (AsyncStepper samples their steps once the step before is read). Finished
        sequences (rows to be discarded) are left unedited.
        """
        picked = [i for i, s in enumerate(seqs) if not s.finished and edits(s)]  # finished: a discarded row
        constrained = [(i, s.grammar) for i, s in enumerate(seqs)
                       if s.grammar is not None and not s.grammar_waits and not s.finished]
        if not picked and not constrained:
            return None
        edited = [seqs[i] for i in picked]
        params = [s.sampling for s in edited]
        m = len(edited)
        penalized = any(p.penalized for p in params)
        held = [(i, t) for i in picked if len(seqs[i].output_ids) + pending < seqs[i].sampling.min_tokens
                for t in sorted(seqs[i].stop_ids)]
        for i in picked:  # bad words of several tokens whose start the output ends with
            seq = seqs[i]
            if seq.needs_host_tokens:
                assert not pending, "a request with multi-token bad words is sampled after its last token is read"
                held += [(i, w[-1]) for w in seq.bad_word_ids
                         if 1 < len(w) <= len(seq.output_ids) + 1 and tuple(seq.output_ids[len(seq.output_ids) - len(w) + 1 :]) == w[:-1]]
        values = [float(i) for i in picked] + [float(self._row(s)) for s in edited]
        if penalized:
            values += [p.repetition_penalty for p in params] + [p.frequency_penalty for p in params]
            values += [p.presence_penalty for p in params]
        values += [float(j) for j, _ in held] + [float(t) for _, t in held]
        up = torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)
        mask = self.masks.fill(constrained, len(seqs)) if constrained else None
        return LogitsEdit(self, up, m, m == len(seqs), any(biased(s) for s in edited),
                          penalized, any(p.repetition_penalty != 1.0 for p in params), len(held),
                          mask, [i for i, _ in constrained])

    def forget(self, seq: Sequence) -> None:
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            self._free.append(row)

    # -- rows ------------------------------------------------------------------------------------------
    def _row(self, seq: Sequence) -> int:
        row = self._rows.get(seq.seq_id)
        if row is not None:
            return row
        if not self._free:
            if self._capacity >= self.max_rows:  # the engine runs at most max_num_seqs, each holds one row
                raise RuntimeError(f"logit-edit state: all {self.max_rows} rows are in use")
            self._grow(min(2 * self._capacity, self.max_rows))
        row = self._free.pop()
        self._rows[seq.seq_id] = row
        self._fill(row, seq)
        return row

    def _fill(self, row: int, seq: Sequence) -> None:
        """The row's state from the host: a sequence gets its row at its first sampled token, and
        again when it resumes after a preemption, each time from a synchronous step, so its
        `output_ids` are all its tokens."""
        sp, dev = seq.sampling, self.device
        if sp.allowed_token_ids is not None:
            self.bias[row].fill_(float("-inf"))
            self.bias[row, _ids(sp.allowed_token_ids, dev)] = 0.0
        else:
            self.bias[row].zero_()
        if sp.logit_bias:
            bias = dict(sp.logit_bias)  # a repeated id: the last bias, as a JSON object's keys
            vals = torch.tensor(list(bias.values()), dtype=torch.float32).to(dev, non_blocking=True)
            self.bias[row].index_put_((_ids(bias, dev),), vals, accumulate=True)  # onto 0 or -inf
        banned = [w[0] for w in seq.bad_word_ids if len(w) == 1]
        if banned:
            self.bias[row, _ids(banned, dev)] = float("-inf")
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        if sp.penalized:
            if seq.output_ids:
                ids = _ids(seq.output_ids, dev)
                self.counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
            self.in_prompt[row, _ids(seq.prompt_ids, dev)] = True

    def _grow(self, capacity: int) -> None:
        capacity = max(capacity, 1)
        old = self._capacity
        bias = torch.zeros(capacity, self.vocab, dtype=torch.float32, device=self.device)
        counts = torch.zeros(capacity, self.vocab, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(capacity, self.vocab, dtype=torch.bool, device=self.device)
        if old:
            bias[:old], counts[:old], in_prompt[:old] = self.bias, self.counts, self.in_prompt
        self.bias, self.counts, self.in_prompt = bias, counts, in_prompt
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity


@dataclass(slots=True)
class LogitsEdit:
    """One step's edit: `apply` to its logits before sampling, `record` its sampled tokens after."""

    state: LogitsProcessors
    # float32 on the device: the edited requests' batch rows, their state rows, their [repetition,
    # frequency, presence] when penalized (kernels.logit_edits' plan), then the (batch row, token)
    # pairs min_tokens holds back
    up: torch.Tensor
    m: int  # edited requests
    every_row: bool  # all of the batch's rows (no gather, no scatter)
    biased: bool
    penalized: bool
    repetition: bool
    n_held: int
    mask: torch.Tensor | None = None  # structured outputs' token bit mask (worker/sampling/structured.py's MaskFiller)
    mask_rows: list[int] | None = None  # the batch rows it constrains

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """An edited float32 copy of `logits` `[batch, vocab]`: the edited requests' rows edited.
        (min_tokens' -inf, then the grammars' masks, last: no edit after them moves an -inf.)"""
        st = self.state
        if self.m:
            out = edit_logits(logits, self.up, self.m, st.bias, st.counts, st.in_prompt, every_row=self.every_row,
                              biased=self.biased, penalized=self.penalized, repetition=self.repetition,
                              backend=st.backend)
        else:  # only grammars: the model's logits stay as they are (logprobs read them)
            out = logits.clone()
        if self.n_held:
            held = self.up[(5 if self.penalized else 2) * self.m :].long().view(2, self.n_held)
            out.index_put_((held[0], held[1]), st.neg_inf)
        if self.mask is not None:
            apply_mask(out, self.mask, self.mask_rows)
        return out

    def record(self, tokens: torch.Tensor) -> None:
        """Count the step's sampled tokens (`[batch]` int64 on the device) in the edited requests' rows."""
        if self.penalized:
            count_tokens(self.state.counts, self.up, self.m, tokens, every_row=self.every_row, backend=self.state.backend)


def _ids(ids, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64).to(device, non_blocking=True)


def bad_word_ids(tokenizer: Tokenizer, words: Seq[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of `bad_words`: each word as written (leading spaces stripped), and again
    after a space where that is a different token sequence of the same length (the word inside a
    text rather than at its start)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [ids for ids in (plain,) if ids]
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(dict.fromkeys(out))

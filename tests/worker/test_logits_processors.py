"""Per-request logit edits (worker/sampling/logits_processors.py) and min-p (worker/sampling/sampler.py) against
transformers' logits processors where it has one (repetition penalty, min new tokens, sequence
bias, min-p), and OpenAI's documented formula for the frequency and presence penalties."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lorafleet.worker.engine.sequence import SamplingParams, Sequence
from lorafleet.worker.sampling.logits_processors import LogitsProcessors
from lorafleet.worker.sampling.sampler import sample, sample_on_device

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

VOCAB = 40
EOS = 1


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def device(request) -> str:
    return request.param


def seq(i: int, prompt: list[int], output: list[int] = (), **knobs) -> Sequence:
    sp = SamplingParams(max_tokens=50, temperature=0.0, **knobs)
    stop = frozenset(sp.stop_token_ids) | ({EOS} if not sp.ignore_eos else set())
    return Sequence(seq_id=i, prompt_ids=list(prompt), sampling=sp, output_ids=list(output), stop_ids=stop)


def edited(procs: LogitsProcessors, seqs: list[Sequence], logits: torch.Tensor, pending: int = 0) -> torch.Tensor:
    """The edit of `logits` (on the CPU) made on the processors' device, back on the CPU."""
    edit = procs.prepare(seqs, pending)
    assert edit is not None
    return edit.apply(logits.to(procs.device)).cpu()


def openai_penalties(row: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty."""
    out = row.clone()
    for token, count in Counter(output).items():
        out[token] -= count * frequency + presence
    return out


def test_repetition_penalty_is_transformers(device):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    prompt, output = [3, 5, 7, 5], [9, 3, 11]
    seqs = [seq(0, prompt, output, repetition_penalty=1.3), seq(1, prompt, output, repetition_penalty=0.7),
            seq(2, prompt, output)]
    got = edited(LogitsProcessors(VOCAB, device), seqs, logits)
    ids = torch.tensor([prompt + output])
    for i, penalty in enumerate([1.3, 0.7]):
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want)
    assert torch.equal(got[2], logits[2]), "a request without edits keeps its logits"


def test_frequency_and_presence_count_only_the_output(device):
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    prompt, output = [4, 4, 6], [6, 8, 8, 8, 2]
    seqs = [seq(0, prompt, output, frequency_penalty=0.5, presence_penalty=-0.25),
            seq(1, prompt, output, presence_penalty=1.5)]
    got = edited(LogitsProcessors(VOCAB, device), seqs, logits)
    torch.testing.assert_close(got[0], openai_penalties(logits[0], output, 0.5, -0.25))
    torch.testing.assert_close(got[1], openai_penalties(logits[1], output, 0.0, 1.5))
    assert got[0, 4] == logits[0, 4], "prompt tokens are not penalised by frequency / presence"


def test_min_tokens_holds_back_stop_tokens_like_transformers(device):
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    prompt = [3, 4]
    seqs = [seq(0, prompt, [5, 6], min_tokens=4, stop_token_ids=(7,)),  # 2 generated < 4: held
            seq(1, prompt, [5, 6, 8, 9], min_tokens=4, stop_token_ids=(7,)),  # 4 generated: free
            seq(2, prompt, [5], min_tokens=3, ignore_eos=True, stop_token_ids=(7,))]
    got = edited(LogitsProcessors(VOCAB, device), seqs, logits)
    for i, s in enumerate(seqs):
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), s.sampling.min_tokens, sorted(s.stop_ids))
        want = hf(torch.tensor([s.prompt_ids + s.output_ids]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want)
    assert math.isinf(got[2, 7]) and got[2, EOS] == logits[2, EOS], "ignore_eos: only stop_token_ids are held"


def test_pending_tokens_count_towards_min_tokens(device):
    """Async scheduling: the token in flight is not in output_ids yet, but it was generated."""
    logits = torch.zeros(1, VOCAB)
    s = seq(0, [3], [5, 6], min_tokens=3)
    assert math.isinf(edited(LogitsProcessors(VOCAB, device), [s], logits, pending=0)[0, EOS])
    assert edited(LogitsProcessors(VOCAB, device), [s], logits, pending=1)[0, EOS] == 0


def test_logit_bias_is_transformers_sequence_bias_and_allowed_ids_mask_the_rest(device):
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB)
    bias = ((5, 100.0), (9, -100.0), (12, 0.5))
    seqs = [seq(0, [3], logit_bias=bias), seq(1, [3], allowed_token_ids=(2, 4, 8), logit_bias=((4, 2.0), (6, 1.0)))]
    got = edited(LogitsProcessors(VOCAB, device), seqs, logits)
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})
    torch.testing.assert_close(got[0], hf(torch.tensor([[3]]), logits[0:1].clone())[0])
    allowed = torch.full((VOCAB,), float("-inf"))
    allowed[[2, 4, 8]] = logits[1, [2, 4, 8]]
    allowed[4] += 2.0
    torch.testing.assert_close(got[1], allowed)


def test_edits_compose_in_vllms_order(device):
    """allowed, then min_tokens and bias, then repetition, frequency, presence: the same pieces
    chained from transformers' processors and OpenAI's formula."""
    torch.manual_seed(4)
    logits = torch.randn(1, VOCAB) * 3
    prompt, output = [3, 5, 9], [5, 11, 11]
    knobs = dict(logit_bias=((11, 1.5), (EOS, 3.0), (3, -0.5)), min_tokens=5, repetition_penalty=1.4,
                 frequency_penalty=0.3, presence_penalty=0.2)
    got = edited(LogitsProcessors(VOCAB, device), [seq(0, prompt, output, **knobs)], logits)[0]
    ids = torch.tensor([prompt + output])
    want = MinNewTokensLengthLogitsProcessor(len(prompt), 5, [EOS])(ids, logits.clone())
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in knobs["logit_bias"]})(ids, want)
    want = RepetitionPenaltyLogitsProcessor(1.4)(ids, want)[0]
    torch.testing.assert_close(got, openai_penalties(want, output, 0.3, 0.2))


def test_sampled_tokens_are_counted_on_the_device_step_after_step(device):
    procs = LogitsProcessors(VOCAB, device)
    s, plain = seq(0, [3], frequency_penalty=1.0), seq(1, [3])
    params = [s.sampling, plain.sampling]
    for _ in range(4):  # every step draws the best token: token 20, whose lead shrinks by 1 a step
        logits = torch.zeros(2, VOCAB, device=device)
        logits[:, 20] = 2.5
        logits[:, 21] = 0.1
        edit = procs.prepare([s, plain], pending=0)
        tokens, _ = sample(logits, params, [None, None], edit=edit)
        s.output_ids.append(tokens[0])  # what the engine does after reading
        plain.output_ids.append(tokens[1])
    assert s.output_ids == [20, 20, 20, 21] and plain.output_ids == [20] * 4
    row = procs._rows[0]
    assert procs.rows_in_use == 1, "the plain request has no row"
    assert procs.counts[row, 20] == 3 and procs.counts[row, 21] == 1 and procs.counts[row].sum() == 4


def test_rows_are_reused_refilled_and_grown(device):
    procs = LogitsProcessors(VOCAB, device)
    many = [seq(i, [3, 4], [5] * i, presence_penalty=1.0) for i in range(1, 10)]  # more than the first 3 rows
    logits = torch.zeros(len(many), VOCAB)
    got = edited(procs, many, logits)
    assert procs.rows_in_use == 9 and procs.counts.shape[0] >= 10
    for i, s in enumerate(many):
        torch.testing.assert_close(got[i], openai_penalties(logits[i], s.output_ids, 0.0, 1.0))
    row = procs._rows[many[0].seq_id]
    procs.forget(many[0])
    fresh = seq(99, [3], [], frequency_penalty=1.0, logit_bias=((7, 2.0),))
    assert edited(procs, [fresh], torch.zeros(1, VOCAB))[0].tolist() == [2.0 if t == 7 else 0.0 for t in range(VOCAB)]
    assert procs._rows[99] == row, "the freed row was reused, refilled from the new request"


def test_warm_up_leaves_the_state_alone(device):
    """The warm-up runs the edit and the counting on scratch rows: no row taken, no state changed,
    and the next request's edit is still transformers'."""
    procs = LogitsProcessors(VOCAB, device)
    before = [t.clone() for t in (procs.bias, procs.counts, procs.in_prompt)]
    procs.warm_up()
    assert procs.rows_in_use == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (procs.bias, procs.counts, procs.in_prompt)))
    s = seq(1, [3, 4], [5, 5], presence_penalty=1.0, frequency_penalty=0.5)
    got = edited(procs, [s], torch.zeros(1, VOCAB))
    torch.testing.assert_close(got[0], openai_penalties(torch.zeros(VOCAB), s.output_ids, 0.5, 1.0))


def test_batches_without_edits_prepare_nothing():
    no_stops = seq(2, [5], min_tokens=3, ignore_eos=True)  # min_tokens with nothing to hold back
    assert LogitsProcessors(VOCAB, "cpu").prepare([seq(0, [3]), seq(1, [4], min_p=0.5), no_stops]) is None


def test_a_reused_row_forgets_the_last_requests_prompt_and_counts(device):
    procs = LogitsProcessors(VOCAB, device)
    first = seq(0, [3, 4, 5], [6, 6], repetition_penalty=2.0, frequency_penalty=1.0)
    edited(procs, [first], torch.ones(1, VOCAB))
    procs.forget(first)
    second = seq(1, [7], [], repetition_penalty=2.0)
    got = edited(procs, [second], torch.ones(1, VOCAB))[0]
    assert procs._rows[1] == procs._rows.get(1) and got[7] == 0.5 and (got[torch.arange(VOCAB) != 7] == 1).all()


def test_logprobs_stay_the_models():
    torch.manual_seed(5)
    logits = torch.randn(1, VOCAB)
    s = seq(0, [3], logit_bias=((17, 100.0),), logprobs=2)
    tokens, lps = sample(logits, [s.sampling], [None], edit=LogitsProcessors(VOCAB, "cpu").prepare([s]))
    assert tokens == [17]
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[17]), abs=1e-6)


def test_edited_rows_never_take_a_decode_graphs_greedy_pick():
    logits = torch.zeros(1, VOCAB)
    s = seq(0, [3], logit_bias=((17, 5.0),))
    stale = (torch.tensor([4]), torch.tensor([4.0]))  # the graph's pick, made before the edit
    out = sample_on_device(logits, [s.sampling], [None], stale, LogitsProcessors(VOCAB, "cpu").prepare([s]))
    assert out.read()[0] == [17]


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_keeps_what_transformers_keeps(min_p):
    torch.manual_seed(6)
    logits = torch.randn(1, 12) * 2
    temperature = 0.7
    kept = MinPLogitsWarper(min_p)(None, logits / temperature)[0] > float("-inf")
    sp = SamplingParams(temperature=temperature, min_p=min_p, seed=0)
    gen = torch.Generator().manual_seed(0)
    drawn = Counter(sample(logits, [sp], [gen])[0][0] for _ in range(3000))
    assert set(drawn) == set(kept.nonzero().view(-1).tolist())


def test_knob_ranges_are_checked():
    for knobs, message in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency"),
                           ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                           ({"min_tokens": 60}, "min_tokens"), ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
                           ({"logit_bias": tuple((t, 1.0) for t in range(1025))}, "at most 1024"),
                           ({"allowed_token_ids": ()}, "allowed_token_ids"),
                           ({"allowed_token_ids": tuple(range((1 << 18) + 1))}, "allowed_token_ids: 1 to"),
                           ({"repetition_penalty": float("inf")}, "repetition_penalty")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(max_tokens=50, **knobs)


def test_bad_words_match_the_output_only(device):
    """vLLM's rule: a longer bad word's last token is banned where the output (not the prompt) ends
    with the rest of it; a one-token word is banned always (in the bias row)."""
    procs = LogitsProcessors(VOCAB, device)
    words = ((7, 9), (12,), (3, 4, 5))
    fresh = seq(0, [2, 7], [], ignore_eos=True, bad_words=("x",))  # ids set below; the prompt ends with 7
    fresh.bad_word_ids = words
    got = edited(procs, [fresh], torch.zeros(1, VOCAB))[0]
    assert got[9] == 0 and math.isinf(got[12]) and got[5] == 0
    later = seq(1, [2], [1, 3, 4], ignore_eos=True, bad_words=("x",))  # ends with 3 4: 5 banned, 9 not
    later.bad_word_ids = words
    got = edited(procs, [later], torch.zeros(1, VOCAB))[0]
    assert math.isinf(got[5]) and got[9] == 0 and math.isinf(got[12])


def test_a_row_left_without_tokens_reads_as_an_error(device):
    """allowed_token_ids all held back by min_tokens (the engine refuses such a request; this is the
    sampler's own guard): the row has no token to draw, and its request ends with an error (-1)."""
    s = seq(0, [3], [], allowed_token_ids=(EOS,), min_tokens=2)
    plain = seq(1, [3])
    logits = torch.zeros(2, VOCAB, device=device)
    procs = LogitsProcessors(VOCAB, device)
    tokens, _ = sample(logits, [s.sampling, plain.sampling], [None, None], edit=procs.prepare([s, plain]))
    assert tokens[0] == -1 and tokens[1] == 0

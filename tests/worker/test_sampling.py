"""Batched sampling: distributions, top-k / top-p, seeds, mixed batches, non-finite rows, logprobs.

Every random draw here comes from a fixed seed (the shared generator is swapped for a seeded one),
so the chi-square bounds are checked against one fixed sample and cannot flake.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet.worker.engine.model_runner import ModelRunner
from lorafleet.worker.engine.sequence import SamplingParams, Sequence
from lorafleet.worker.sampling import sampler as sampling
from lorafleet.worker.sampling.logits_processors import LogitsProcessors
from lorafleet.worker.sampling.sampler import sample, sample_on_device

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
# chi-square 0.9999 quantiles by degrees of freedom: a correct sampler stays below with p = 1e-4.
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}

LOGITS8 = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0]  # distinct: no ties at any threshold


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> torch.device:
    dev = torch.empty(0, device=request.param).device  # cuda -> cuda:0, the key sample() uses
    monkeypatch.setitem(sampling._shared_generators, dev, torch.Generator(device=dev).manual_seed(1234))
    return dev


def gen(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the support of `probs`, and its degrees of freedom."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token of probability 0"
    expected = probs[support].double() * len(tokens)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def draw_many(device, row: list[float], sp: SamplingParams, n: int = 40_000) -> list[int]:
    logits = torch.tensor([row], device=device).expand(n, -1).contiguous()
    tokens, _ = sample(logits, [sp] * n, [None] * n)
    return tokens


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_unseeded_rows_follow_the_softmax(device, temperature):
    tokens = draw_many(device, LOGITS8, SamplingParams(temperature=temperature))
    stat, dof = chi_square(tokens, torch.softmax(torch.tensor(LOGITS8) / temperature, -1))
    assert stat < CHI2_9999[dof], stat


def test_a_seeded_row_follows_the_softmax_step_after_step(device):
    sp = SamplingParams(temperature=1.0, seed=5)
    g = gen(5, device)
    logits = torch.tensor([LOGITS8], device=device)
    tokens = [sample(logits, [sp], [g])[0][0] for _ in range(6000)]
    stat, dof = chi_square(tokens, torch.softmax(torch.tensor(LOGITS8), -1))
    assert stat < CHI2_9999[dof], stat


def test_unseeded_rows_draw_fresh_noise_every_step(device):
    logits = torch.zeros(1, 50, device=device)
    tokens = [sample(logits, [SamplingParams()], [None])[0][0] for _ in range(40)]
    assert len(set(tokens)) > 15


def test_top_k_never_leaves_the_k_best(device):
    torch.manual_seed(0)
    n, vocab = 3000, 64
    logits = (torch.randn(n, vocab) * 3).to(device)
    ks = [2 + i % 9 for i in range(n)]
    params = [SamplingParams(temperature=1.5, top_k=k) for k in ks]
    tokens, _ = sample(logits, params, [None] * n)
    for row, (tok, k) in enumerate(zip(tokens, ks)):
        assert tok in set(logits[row].topk(k).indices.tolist())


def test_top_k_samples_the_renormalised_k_best(device):
    tokens = draw_many(device, LOGITS8, SamplingParams(top_k=3))
    probs = torch.softmax(torch.tensor(LOGITS8), -1)
    probs[probs.topk(5, largest=False).indices] = 0.0
    stat, dof = chi_square(tokens, probs / probs.sum())
    assert dof == 2 and stat < CHI2_9999[dof], stat


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference: the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs)
    mass = 0.0
    for t in order.tolist():
        kept[t] = probs[t]
        mass += float(probs[t])
        if mass >= top_p:
            break
    return kept / kept.sum()


@pytest.mark.parametrize("top_p", [0.3, 0.55, 0.8, 0.95])
def test_top_p_keeps_the_minimal_nucleus(device, top_p):
    probs = torch.softmax(torch.tensor(LOGITS8), -1)  # sorted .40 .24 .15 .09 .05 .03 .02 .01 (0, 6, 1, 2, ...)
    want = nucleus(probs, top_p)
    tokens = draw_many(device, LOGITS8, SamplingParams(top_p=top_p))
    assert set(tokens) == set(want.nonzero().flatten().tolist())
    stat, dof = chi_square(tokens, want)
    if dof:
        assert stat < CHI2_9999[dof], stat


def test_top_k_then_top_p_and_unfiltered_rows_in_one_batch(device):
    probs = torch.softmax(torch.tensor(LOGITS8), -1)
    n = 3000
    rows = torch.tensor([LOGITS8], device=device).expand(3 * n, -1).contiguous()
    params = (
        [SamplingParams(top_k=3, top_p=0.9)] * n  # top-3 renormalised: .51/.31/.19: 0.9 keeps all three
        + [SamplingParams(top_k=4, top_p=0.6)] * n  # top-4 renormalised: .46 + .28 reach 0.6
        + [SamplingParams()] * n  # no knobs: the whole softmax, although the batch is sorted
    )
    tokens, _ = sample(rows, params, [None] * (3 * n))
    assert set(tokens[:n]) == {0, 6, 1}
    assert set(tokens[n : 2 * n]) == {0, 6}
    stat, dof = chi_square(tokens[2 * n :], probs)
    assert stat < CHI2_9999[dof], stat


@pytest.mark.parametrize("vocab", [5000, 5003, 130_000])  # chunks of 1000; padded chunks; a big vocab
def test_top_p_threshold_on_large_vocabularies(device, vocab):
    torch.manual_seed(vocab)
    n = 24
    scaled = (torch.randn(n, vocab, dtype=torch.float64) * torch.linspace(0.5, 6, n, dtype=torch.float64)[:, None])
    top_p = torch.linspace(0.05, 0.99, n, dtype=torch.float64)
    k_index = torch.full((n, 1), vocab - 1)
    k_index[::3] = 40  # every third row also keeps at most its 41 best
    got = sampling._threshold(scaled.float().to(device), k_index.to(device), top_p.float()[:, None].to(device),
                              41, True).cpu().double()
    for row in range(n):
        desc = scaled[row].float().double().sort(descending=True).values
        desc = desc[: int(k_index[row]) + 1]
        running = torch.softmax(desc, -1).cumsum(-1)
        c = int((running < top_p[row]).sum())
        if min(abs(running[max(c - 1, 0) : c + 1] - top_p[row])) < 1e-4:
            continue  # too close to call in float32
        assert got[row, 0] == desc[min(c, len(desc) - 1)], row


def seeded_run(device, logits: torch.Tensor, sp: SamplingParams, others, position: int, steps: int = 25):
    """Tokens of one seeded row over `steps` steps, sampled at `position` among `others` rows."""
    g = gen(sp.seed, device)
    out = []
    for step in range(steps):
        batch_params = list(p for p, _ in others)
        batch_gens = list(g_ for _, g_ in others)
        batch_params.insert(position, sp)
        batch_gens.insert(position, g)
        torch.manual_seed(step)
        other_logits = torch.randn(len(others), logits.shape[-1]).to(device) * 4
        rows = torch.cat([other_logits[:position], logits[None], other_logits[position:]])
        out.append(sample(rows, batch_params, batch_gens)[0][position])
    return out


# 200: the running sum in one scan; 5,000: in chunks of 1,000 with their carries (sampler._count_cumsum_below),
# the path a real vocabulary takes (40,000 cost 8x the time here and checked the same path).
@pytest.mark.parametrize("vocab", [200, 5_000])
@pytest.mark.parametrize("knobs", [{}, {"top_k": 20}, {"top_p": 0.9}, {"top_k": 30, "top_p": 0.8, "temperature": 0.7}])
def test_seeded_rows_repeat_whatever_shares_the_batch(device, knobs, vocab):
    torch.manual_seed(99)
    logits = (torch.randn(vocab) * 2).to(device)
    sp = SamplingParams(seed=42, **knobs)
    alone = seeded_run(device, logits, sp, [], 0)
    assert len(set(alone)) > 5  # it really samples
    batches = [
        [(SamplingParams(temperature=0.0), None)] * 3,  # greedy neighbours
        [(SamplingParams(), None)] * 7,  # unseeded neighbours: shared generator, no filtering
        [(SamplingParams(top_k=5), None), (SamplingParams(seed=42), gen(42, device))],  # topk path, same seed
        [(SamplingParams(top_p=0.5, seed=7), gen(7, device)), (SamplingParams(temperature=0.3), None)],  # sort path
    ]
    for others in batches:
        for position in (0, len(others)):
            assert seeded_run(device, logits, sp, others, position) == alone
    assert seeded_run(device, logits, SamplingParams(seed=43, **knobs), [], 0) != alone


def test_mixed_greedy_and_sampled_rows(device):
    torch.manual_seed(3)
    logits = (torch.randn(12, 100) * 3).to(device)
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0
        else SamplingParams(temperature=0.9, top_k=1) if i % 3 == 1  # top_k 1 is greedy too
        else SamplingParams(temperature=5.0, top_p=0.99, seed=i)
        for i in range(12)
    ]
    gens = [gen(i, device) if i % 3 == 2 else None for i in range(12)]
    runs = [sample(logits, params, [gen(i, device) if i % 3 == 2 else None for i in range(12)])[0] for _ in range(2)]
    assert runs[0] == runs[1]  # all seeded or greedy: the whole batch repeats
    argmax = logits.argmax(-1).tolist()
    hot = []
    for _ in range(5):
        tokens, _ = sample(logits, params, gens)
        assert [tokens[i] for i in range(12) if i % 3 != 2] == [argmax[i] for i in range(12) if i % 3 != 2]
        hot += [tokens[i] != argmax[i] for i in range(2, 12, 3)]
    assert any(hot)  # temperature 5 wanders off the argmax


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 9.9e-6])
def test_a_temperature_below_1e_5_is_greedy(device, temperature):
    """As float32 such a temperature is 0 or subnormal: logits / T overflowed to inf (nan at 0 / 0)
    and the first overflowing token won, not the best one."""
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=1e-5).greedy
    logits = torch.tensor([[30.0, 0.0, 50.0, 40.0, -3.0, 45.0]] * 16, device=device)
    params = [SamplingParams(temperature=temperature, seed=i if i % 2 else None, logprobs=1) for i in range(16)]
    gens = [gen(i, device) if i % 2 else None for i in range(16)]
    tokens, logprobs = sample(logits, params, gens)
    assert tokens == [2] * 16
    assert all(lp.top[0][0] == 2 for lp in logprobs)


def test_non_finite_rows_get_minus_one_and_leave_the_others_alone(device):
    torch.manual_seed(4)
    good = (torch.randn(3, 50) * 2).to(device)
    bad = torch.randn(3, 50).to(device)
    bad[0, 7], bad[1, 0], bad[2, 49] = float("nan"), float("inf"), float("-inf")
    sps = [SamplingParams(seed=1, logprobs=2), SamplingParams(temperature=0.0, logprobs=1), SamplingParams(seed=3, top_p=0.5)]
    want_tokens, want_lp = sample(good, sps, [gen(1, device), None, gen(3, device)])

    rows = torch.stack([bad[0], good[0], bad[1], good[1], good[2], bad[2]])
    params = [SamplingParams(logprobs=3), sps[0], SamplingParams(temperature=0.0), sps[1], sps[2], SamplingParams(seed=9)]
    gens = [None, gen(1, device), None, None, gen(3, device), gen(9, device)]
    tokens, logprobs = sample(rows, params, gens)
    assert [tokens[i] for i in (0, 2, 5)] == [-1, -1, -1]
    assert [tokens[i] for i in (1, 3, 4)] == want_tokens
    assert logprobs[0] is None and logprobs[2] is None and logprobs[5] is None
    assert [logprobs[i] for i in (1, 3, 4)] == want_lp


def test_logprobs_are_the_models_log_softmax(device):
    torch.manual_seed(5)
    logits = (torch.randn(6, 40) * 3).to(device)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=0),  # knobs do not change the reported logprobs
        SamplingParams(),  # no logprobs asked
        SamplingParams(temperature=1.2, top_p=0.3, logprobs=20),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=2, logprobs=1),
    ]
    gens = [None, None, None, None, None, gen(2, device)]
    tokens, logprobs = sample(logits, params, gens)
    ref = torch.log_softmax(logits.cpu(), -1)
    assert logprobs[2] is None and logprobs[4] is None
    for i in (0, 1, 3, 5):
        lp = logprobs[i]
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        k = params[i].logprobs
        assert [t for t, _ in lp.top] == ref[i].topk(k).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref[i].topk(k).values.tolist(), abs=1e-5)
    # Every row asking (no subset gather) gives the same values.
    all_rows = [SamplingParams(temperature=0.0, logprobs=2)] * 6
    _, full = sample(logits, all_rows, [None] * 6)
    assert [lp.top for lp in full] == [
        [(t, pytest.approx(v, abs=1e-5)) for t, v in zip(ids, vals)]
        for ids, vals in zip(ref.topk(2).indices.tolist(), ref.topk(2).values.tolist())
    ]


def test_a_decode_graphs_greedy_pick_is_taken_only_for_plain_greedy_batches(device):
    """`greedy` (a decode graph's picks, kernels/sampling/greedy.py) is what an all-greedy batch without
    logprobs reads; any row that samples or asks for logprobs sends the batch through the logits,
    converted to float32 there (the graph leaves them bf16): the same tokens as sampling the
    float32 logits."""
    torch.manual_seed(6)
    logits = (torch.randn(4, 64) * 4).to(device=device, dtype=torch.bfloat16)
    marked = (torch.tensor([5, 6, 7, 8], device=device), torch.tensor([5, -1, 7, 8], device=device))
    plain = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 2
    assert sample(logits, plain, [None] * 4, marked)[0] == [5, -1, 7, 8]  # taken as they are
    want = logits.float().argmax(-1).tolist()
    for other in (SamplingParams(temperature=0.0, logprobs=0), SamplingParams(seed=3)):
        params = plain[:3] + [other]
        gens = [None] * 3 + [gen(3, device) if other.seed is not None else None]
        tokens, lps = sample(logits, params, gens, marked)
        assert tokens[:3] == want[:3]
        ref_gens = [None] * 3 + [gen(3, device) if other.seed is not None else None]
        assert (tokens, lps) == sample(logits.float(), params, ref_gens)


def test_one_host_read_per_step(device, monkeypatch):
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1]
        )
    logits = torch.randn(8, 30, device=device)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=4, logprobs=3), SamplingParams(top_p=0.7, seed=1),
              SamplingParams(logprobs=0), SamplingParams(), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(top_k=2), SamplingParams(seed=3)]
    gens = [None, None, gen(1, device), None, None, None, None, gen(3, device)]
    sample(logits, params, gens)
    assert reads == ["tolist"]
    reads.clear()
    sample(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    assert reads == ["tolist"]


def test_empty_batch():
    assert sample(torch.empty(0, 10), [], []) == ([], [])


def test_only_seeded_requests_own_a_generator():
    runner = SimpleNamespace(_generators={}, device=torch.device("cpu"),
                             logits_processors=LogitsProcessors(10, torch.device("cpu")))

    def seq(i, **kw):
        return Sequence(seq_id=i, prompt_ids=[1], sampling=SamplingParams(**kw))

    assert ModelRunner.generator_for(runner, seq(1, temperature=0.0, seed=3)) is None
    assert ModelRunner.generator_for(runner, seq(2)) is None
    seeded = seq(3, seed=11)
    g = ModelRunner.generator_for(runner, seeded)
    assert g is not None and ModelRunner.generator_for(runner, seeded) is g
    assert g.initial_seed() == 11
    ModelRunner.forget(runner, seeded)
    assert runner._generators == {}


def test_sample_on_device_reads_like_sample():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[3, 7] = float("inf")
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=4)]
    sampled = sample_on_device(logits, params, [None] * 5).start_copy()
    assert sampled.read() == sample(logits, params, [None] * 5)
    tokens, _ = sampled.read()
    assert tokens[3] == -1 and 0 <= int(sampled.token_ids[3]) < 50  # the device ids stay valid to feed

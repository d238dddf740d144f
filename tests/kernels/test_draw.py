"""The sort-free draw (`kernels/sampling/draw_triton.py`) against the torch draw (`worker/sampling/sampler.py`'s
`draw_reference`, itself checked against transformers' warpers in tests/worker/test_sampling.py):
the same logits, knobs and noise give the same token in every row, across greedy, temperature,
min-p, top-k, top-p and their mixes, ties, -inf entries, and rows that are not finite. In the
interpreter at small vocabularies (partial last blocks), compiled on CUDA (`-m gpu`) at the seed
vocabulary; and the kernel compiles for sm_90 without a GPU."""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.sampling.draw_triton import draw_triton
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.sampling.sampler import _Knobs, draw_reference, top_k_floor
from tests.kernels.hopper_compile import run_hopper_compile

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# One row per case; mixed in one batch, as the engine's steps mix them.
KNOBS = [
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.8, top_k=1),
    dict(temperature=0.8, top_k=2),
    dict(temperature=0.8, top_k=37),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.5, top_p=0.01),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=2.0, top_p=0.999),
    dict(temperature=0.9, top_k=50, top_p=0.9),
    dict(temperature=1.0, top_k=3, top_p=0.6),
    dict(temperature=1.0, top_k=400, top_p=0.3),
    dict(temperature=1.1, top_k=20, top_p=0.95, min_p=0.1),
    dict(temperature=1.0, min_p=0.2, top_p=0.8),
]


def _draw_both(logits: torch.Tensor, params: list[SamplingParams], g: torch.Generator):
    n, vocab = logits.shape
    knobs = _Knobs(params, vocab)
    knobs_t = torch.tensor(knobs.values, dtype=torch.float32).view(_Knobs.ROWS, n).to(DEVICE)
    log_noise = torch.empty(n, vocab).exponential_(generator=g).clamp_min_(1e-38).log_().to(DEVICE)
    logits = logits.to(DEVICE)
    got = draw_triton(logits, knobs_t, log_noise, top_k_floor(logits, knobs_t, knobs.k_max))
    want = draw_reference(logits, knobs_t, log_noise.clone(), knobs.k_max, knobs.any_p, knobs.any_min_p)
    return got.cpu(), want.cpu()


def _params(knobs: list[dict]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=4, **k) for k in knobs]


@pytest.mark.parametrize("vocab,scale", [(3000, 3.0), (1500, 8.0), (777, 1.0)])
def test_same_token_as_the_torch_draw(vocab, scale):
    g = torch.Generator().manual_seed(vocab)
    params = _params(KNOBS)
    for trial in range(3):
        logits = torch.randn(len(params), vocab, generator=g) * scale
        got, want = _draw_both(logits, params, g)
        assert torch.equal(got, want), (trial, got.tolist(), want.tolist())


@pytest.mark.parametrize("block, num_warps", [(1024, 4), (8192, 16)])
def test_other_launch_settings_draw_the_same_token(block, num_warps):
    """The launch setting passed in (`block`, `num_warps`: what bench/sampling_cost.py --sweep compares)
    changes nothing but the speed: the same token as the torch draw in every row."""
    g = torch.Generator().manual_seed(block)
    params = _params(KNOBS)
    n, vocab = len(params), 2500
    logits = (torch.randn(n, vocab, generator=g) * 3).to(DEVICE)
    knobs = _Knobs(params, vocab)
    knobs_t = torch.tensor(knobs.values, dtype=torch.float32).view(_Knobs.ROWS, n).to(DEVICE)
    log_noise = torch.empty(n, vocab).exponential_(generator=g).clamp_min_(1e-38).log_().to(DEVICE)
    got = draw_triton(logits, knobs_t, log_noise, top_k_floor(logits, knobs_t, knobs.k_max), block=block,
                      num_warps=num_warps)
    want = draw_reference(logits, knobs_t, log_noise.clone(), knobs.k_max, knobs.any_p, knobs.any_min_p)
    assert torch.equal(got.cpu(), want.cpu())


def test_ties_and_masked_tokens():
    """bf16-like coarse logits (many ties, also at the k-th value), -inf entries (allowed ids, bias)."""
    g = torch.Generator().manual_seed(1)
    vocab = 2100
    params = _params(KNOBS)
    for trial in range(3):
        logits = torch.round(torch.randn(len(params), vocab, generator=g) * 8) / 4
        logits[:, ::3] = float("-inf")
        logits[2, :2000] = float("-inf")  # fewer kept tokens than top-k asks for in some rows
        logits[11, :-2] = float("-inf")
        got, want = _draw_both(logits, params, g)
        assert torch.equal(got, want), (trial, got.tolist(), want.tolist())


def test_a_flat_row_and_ties_at_the_max():
    vocab = 1025
    params = _params(KNOBS)
    logits = torch.zeros(len(params), vocab)
    logits[5:, 100:110] = 4.0  # ten tokens tied at the max
    got, want = _draw_both(logits, params, torch.Generator().manual_seed(2))
    assert torch.equal(got, want)


def test_rows_that_are_not_finite_end_with_a_valid_index():
    vocab = 1100
    params = _params([dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=5, top_p=0.9),
                      dict(temperature=0.0), dict(temperature=1.0, min_p=0.1), dict(temperature=1.0, top_p=0.9)])
    logits = torch.randn(len(params), vocab)
    logits[0] = float("-inf")
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    logits[3, 9] = float("inf")
    got, _ = _draw_both(logits, params, torch.Generator().manual_seed(3))
    assert all(0 <= t < vocab for t in got.tolist())
    assert got[4] >= 0


def test_the_sampled_distribution_is_the_nucleus():
    """Over many draws of one row the kernel's tokens follow the renormalised top-k / top-p
    distribution computed in float64 (an oracle independent of both draws' code)."""
    vocab, draws = 40, 1000
    logits = torch.linspace(-3, 3, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(4))]
    params = _params([dict(temperature=1.0, top_k=12, top_p=0.7)] * draws)
    knobs = _Knobs(params, vocab)
    knobs_t = torch.tensor(knobs.values, dtype=torch.float32).view(_Knobs.ROWS, draws).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    log_noise = torch.empty(draws, vocab).exponential_(generator=g).clamp_min_(1e-38).log_().to(DEVICE)
    rows = logits.expand(draws, vocab).contiguous().to(DEVICE)
    tokens = draw_triton(rows, knobs_t, log_noise, top_k_floor(rows, knobs_t, knobs.k_max))
    p = torch.softmax(logits.double(), 0)
    order = p.argsort(descending=True)
    top = p[order[:12]] / p[order[:12]].sum()
    keep = int((top.cumsum(0) < 0.7).sum()) + 1
    want = torch.zeros(vocab, dtype=torch.float64)
    want[order[:keep]] = top[:keep] / top[:keep].sum()
    seen = torch.bincount(tokens.cpu(), minlength=vocab).double() / draws
    assert set(seen.nonzero().view(-1).tolist()) <= set(order[:keep].tolist())
    sd = torch.sqrt(want * (1 - want) / draws)
    assert bool((seen - want).abs().le(5 * sd + 1e-9).all()), (seen[order[:keep]], want[order[:keep]])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_seed_vocabulary_on_cuda():
    g = torch.Generator().manual_seed(0)
    vocab = 100_000
    params = _params(KNOBS * 4)
    for scale in (3.0, 12.0):
        logits = (torch.randn(len(params), vocab, generator=g) * scale).to(torch.bfloat16).float()
        got, want = _draw_both(logits, params, g)
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_one_compile_whatever_the_batch_size():
    """The batch size is not specialised on, so the engine's warm-up compiles every variant a step
    can take (with and without a top-k floor) whatever batches come later."""
    from lorafleet.kernels.sampling.draw_triton import _draw_kernel

    caches = getattr(_draw_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its kernel cache elsewhere")
    vocab = 5000
    sizes = []
    for n in (1, 2, 16, 64, 3):
        params = _params([dict(temperature=0.9, top_p=0.8)] * n)
        _draw_both(torch.randn(n, vocab), params, torch.Generator().manual_seed(n))
        sizes.append(sum(len(c[0]) for c in caches.values()))
    assert sizes[1:] == sizes[:1] * 4, sizes


HOPPER_COMPILE = r"""
from lorafleet.kernels.sampling import draw_triton as d

sig = {"logits_ptr": "*fp32", "noise_ptr": "*fp32", "knobs_ptr": "*fp32", "floor_ptr": "*fp32", "tokens_ptr": "*i64",
       "n": "i32", "vocab": "i32", "stride_l": "i32", "stride_e": "i32"}
for top_k in (False, True):
    k = compile_(d._draw_kernel, sig, dict(TOP_K=top_k, BLOCK=d.BLOCK), warps=d.NUM_WARPS, divisible=("vocab",))
    assert "div.rn.f32" in k.asm["ptx"], "scaled must be torch's division"
print("ok")
"""


def test_compiles_for_hopper():
    """The kernel compiles to sm_90 with and without a top-k floor (no GPU needed)."""
    run_hopper_compile(HOPPER_COMPILE)

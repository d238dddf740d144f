"""The logit-edit kernels (`kernels/sampling/logit_edits_triton.py`) against their torch reference
(`kernels/sampling/logit_edits.py`, itself checked against transformers' processors in
tests/worker/test_logits_processors.py): in the interpreter on small odd vocabularies (a partial last
block), compiled on CUDA (`-m gpu`) at the seed vocabulary."""

from __future__ import annotations

import itertools

import pytest
import torch

from lorafleet.kernels.sampling.logit_edits import count_tokens, edit_logits
from tests.kernels.hopper_compile import run_hopper_compile

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _state(pool: int, vocab: int, g: torch.Generator):
    bias = torch.randn(pool, vocab, generator=g) * 2
    bias[0, ::7] = float("-inf")  # allowed_token_ids' mask
    counts = torch.randint(0, 4, (pool, vocab), generator=g, dtype=torch.int32) * (torch.rand(pool, vocab, generator=g) < 0.1)
    in_prompt = torch.rand(pool, vocab, generator=g) < 0.05
    return [t.to(DEVICE) for t in (bias, counts, in_prompt)]


def _plan(picked: list[int], rows: list[int], g: torch.Generator) -> torch.Tensor:
    m = len(picked)
    knobs = torch.cat([torch.rand(m, generator=g) * 1.5 + 0.25, torch.rand(m, generator=g) * 4 - 2,
                       torch.rand(m, generator=g) * 4 - 2])
    return torch.cat([torch.tensor(picked + rows, dtype=torch.float32), knobs]).to(DEVICE)


FLAGS = [dict(biased=b, penalized=p, repetition=r) for b, p, r in itertools.product([False, True], repeat=3) if p or not r]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "-".join(k for k, v in f.items() if v) or "copy")
@pytest.mark.parametrize("vocab,picked,rows,batch", [
    (2500, [1, 3], [2, 0], 5),  # a subset of the batch, a partial last block
    (300, [0, 1, 2], [4, 1, 3], 3),  # every row
])
def test_the_kernel_is_the_reference(flags, vocab, picked, rows, batch):
    g = torch.Generator().manual_seed(vocab + len(picked))
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(DEVICE)
    logits[0, 5] = float("-inf")
    bias, counts, in_prompt = _state(5, vocab, g)
    plan = _plan(picked, rows, g)
    every = picked == list(range(batch))
    args = (logits, plan, len(picked), bias, counts, in_prompt)
    got = edit_logits(*args, every_row=every, backend="triton", **flags)
    want = edit_logits(*args, every_row=every, backend="torch", **flags)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert logits[0, 5] == float("-inf"), "the model's logits are left alone"
    if not every:
        others = [i for i in range(batch) if i not in picked]
        assert torch.equal(got[others], logits[others])


@pytest.mark.parametrize("every", [False, True])
def test_counting_is_the_reference(every):
    g = torch.Generator().manual_seed(3)
    vocab, batch = 700, 6
    picked = list(range(batch)) if every else [0, 2, 5]
    rows = [3, 1, 6, 0, 2, 4][: len(picked)]
    plan = _plan(picked, rows, g)
    tokens = torch.randint(0, vocab, (batch,), generator=g).to(DEVICE)
    base = torch.randint(0, 3, (8, vocab), generator=g, dtype=torch.int32).to(DEVICE)
    got, want = base.clone(), base.clone()
    count_tokens(got, plan, len(picked), tokens, every_row=every, backend="triton")
    count_tokens(want, plan, len(picked), tokens, every_row=every, backend="torch")
    assert torch.equal(got, want) and int((got - base).sum()) == len(picked)


def test_counting_more_requests_than_one_iteration_takes():
    from lorafleet.kernels.sampling.logit_edits_triton import COUNT_BLOCK

    g = torch.Generator().manual_seed(4)
    vocab, batch = 64, COUNT_BLOCK + 70
    plan = _plan(list(range(batch)), list(range(batch))[::-1], g)
    tokens = torch.randint(0, vocab, (batch,), generator=g).to(DEVICE)
    got, want = (torch.zeros(batch, vocab, dtype=torch.int32, device=DEVICE) for _ in range(2))
    count_tokens(got, plan, batch, tokens, every_row=True, backend="triton")
    count_tokens(want, plan, batch, tokens, every_row=True, backend="torch")
    assert torch.equal(got, want) and int(got.sum()) == batch


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_one_compile_whatever_the_edits():
    """The edits, rows and request count are runtime arguments: after the first call, no mix of them
    compiles anything (the engine's warm-up makes that first call)."""
    from lorafleet.kernels.sampling import logit_edits_triton as le

    if getattr(le._edit_kernel, "device_caches", None) is None:
        pytest.skip("this Triton keeps its kernel cache elsewhere")

    def compiled() -> int:
        return sum(len(c[0]) for k in (le._edit_kernel, le._count_kernel) for c in k.device_caches.values())

    g = torch.Generator().manual_seed(5)
    vocab = 4096
    logits = (torch.randn(8, vocab, generator=g) * 3).to(DEVICE)
    bias, counts, in_prompt = _state(9, vocab, g)
    sizes = []
    for picked in ([0], list(range(8)), [1, 5]):
        plan = _plan(picked, [8 - i for i in range(len(picked))], g)
        for flags in FLAGS:
            every = len(picked) == 8
            edit_logits(logits, plan, len(picked), bias, counts, in_prompt, every_row=every, backend="triton", **flags)
            count_tokens(counts, plan, len(picked), torch.zeros(8, dtype=torch.int64, device=DEVICE), every_row=every,
                         backend="triton")
            sizes.append(compiled())
    assert len(set(sizes)) == 1, sizes


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_seed_vocabulary_on_cuda():
    g = torch.Generator().manual_seed(0)
    vocab, batch = 100_000, 64
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(DEVICE)
    bias, counts, in_prompt = _state(80, vocab, g)
    for picked in (list(range(batch)), list(range(0, batch, 8))):
        plan = _plan(picked, [70 - i for i in range(len(picked))], g)
        args = (logits, plan, len(picked), bias, counts, in_prompt)
        flags = dict(every_row=len(picked) == batch, biased=True, penalized=True, repetition=True)
        torch.testing.assert_close(edit_logits(*args, backend="triton", **flags),
                                   edit_logits(*args, backend="torch", **flags), rtol=1e-6, atol=1e-5)


HOPPER_COMPILE = r"""
from lorafleet.kernels.sampling import logit_edits_triton as le

sig = {"logits": "*fp32", "out": "*fp32", "plan": "*fp32", "bias": "*fp32", "counts": "*i32", "in_prompt": "*u8",
       "m": "i32", "vocab": "i32", "stride_l": "i32", "stride_o": "i32", "every_row": "i32", "biased": "i32",
       "penalized": "i32", "repetition": "i32"}
# As the JIT specializes a vocabulary divisible by 16 (100,000; 32,000; 128,256; 151,936)
k = compile_(le._edit_kernel, sig, dict(BLOCK=le.BLOCK), divisible=("vocab",))
assert "ld.global.v4" in k.asm["ptx"], "logits loads are not vectorised"
count = {"counts": "*i32", "plan": "*fp32", "tokens": "*i64", "m": "i32", "stride_c": "i32", "every_row": "i32"}
k = compile_(le._count_kernel, count, dict(BLOCK=le.COUNT_BLOCK), warps=1)
assert "atom.global" in k.asm["ptx"] or "red.global" in k.asm["ptx"]
print("ok")
"""


def test_compiles_for_hopper():
    """Both kernels compile to sm_90 (one variant each: the edits are runtime arguments), the edit's
    loads 16 bytes wide (no GPU needed)."""
    run_hopper_compile(HOPPER_COMPILE)

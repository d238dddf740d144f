"""DoRA's epilogue (kernels/lora/dora.py): the torch reference against PEFT's formula written out
per token, and the Triton kernel against the reference.

Without CUDA the kernel runs in the Triton interpreter (conftest.py). Cases: bf16 / fp16 / fp32,
widths that are not multiples of the block, one to many tokens, DoRA, plain-LoRA and base tokens
in one step, two entries per token, with and without a deferred delta and a bias, and bad
arguments refused. `@pytest.mark.gpu`: the kernel captured in a CUDA graph sees slots turn DoRA
and back between replays.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.lora.dora import dora_epilogue, dora_epilogue_reference, dora_epilogue_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def case(t: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """4 slots: 0 and 2 DoRA, 1 and 3 plain LoRA; tokens cycle through base, slots 0..3."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t, n, generator=gen).to(dtype)
    delta = torch.randn(t, n, generator=gen).to(dtype)
    g = (1 + 0.3 * torch.randn(4, n, generator=gen)).float()
    is_dora = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    slots = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        slots[i, 0] = i % 5 - 1  # -1 (base), 0, 1, 2, 3
        if k > 1 and slots[i, 0] in (1, 3):  # plain LoRA tokens may have a second adapter
            slots[i, 1] = 3 if slots[i, 0] == 1 else 1
    bias = torch.randn(n, generator=gen).to(dtype)
    return y, delta, g, is_dora, slots, bias


def peft_rows(y, delta, g, is_dora, slots, bias):
    """Per token, PEFT's eval forward: result + (g - 1) * (result - bias) + g * lora (float64)."""
    out = y.double() + (delta.double() if delta is not None else 0)
    for t in range(y.shape[0]):
        s = int(slots[t, 0])
        if s < 0 or not is_dora[s]:
            continue
        base = y[t].double() - (bias.double() if bias is not None else 0)
        lora = delta[t].double() if delta is not None else y.new_zeros(y.shape[1]).double()
        result = y[t].double()
        out[t] = result + (g[s].double() - 1) * base + g[s].double() * lora
    return out


@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_is_peft_formula(with_delta, with_bias):
    y, delta, g, is_dora, slots, bias = case(11, 37, 1, torch.float32)
    d = delta if with_delta else None
    b = bias if with_bias else None
    # Without a deferred delta the LoRA is already in y: PEFT's base result is y - lora.
    want = peft_rows(y if with_delta else y - delta, delta, g, is_dora, slots, b)
    got = (y if with_delta else y.clone()).clone()
    d_in = d.clone() if d is not None else None
    dora_epilogue_reference(got, d_in, g, is_dora, slots, b)
    if d_in is not None:  # the reader adds the delta back (zero on DoRA rows)
        got = got + d_in
    assert torch.allclose(got.double(), want, atol=1e-5)
    base_rows = (slots[:, 0] < 0) | (is_dora[slots[:, 0].clamp(min=0).long()] == 0)
    assert torch.equal(got[base_rows], (y + (delta if with_delta else 0))[base_rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 64), (5, 37), (33, 1000), (7, 2100), (64, 96)])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("with_delta,with_bias", [(True, True), (False, False), (True, False)])
def test_triton_matches_reference(dtype, t, n, k, with_delta, with_bias):
    y, delta, g, is_dora, slots, bias = case(t, n, k, dtype, seed=t * n + k)
    d = delta if with_delta else None
    b = bias if with_bias else None
    want_y, want_d = y.clone(), d.clone() if d is not None else None
    dora_epilogue_reference(want_y, want_d, g, is_dora, slots, b)
    dev = [x.to(DEVICE) if x is not None else None for x in (y, d, g, is_dora, slots, b)]
    dora_epilogue_triton(*dev, block_n=256)
    assert torch.allclose(dev[0].float().cpu(), want_y.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if d is not None:
        assert torch.equal(dev[1].cpu(), want_d)


def test_no_dora_token_changes_nothing():
    y, delta, g, is_dora, slots, bias = case(9, 50, 1, torch.float32)
    is_dora.zero_()
    y0, d0 = y.clone(), delta.clone()
    for backend in ("torch", "triton"):
        dev = [x.to(DEVICE) for x in (y, delta, g, is_dora, slots, bias)]
        dora_epilogue(*dev, backend=backend)
        assert torch.equal(dev[0].cpu(), y0) and torch.equal(dev[1].cpu(), d0)


def test_bad_arguments_are_refused():
    y, delta, g, is_dora, slots, bias = case(4, 16, 1, torch.float32)
    with pytest.raises(ValueError):
        dora_epilogue_reference(y, delta, g[:, :8], is_dora, slots, bias)
    with pytest.raises(ValueError):
        dora_epilogue_reference(y, delta[:2], g, is_dora, slots, bias)
    with pytest.raises(ValueError):
        dora_epilogue_triton(y, delta, g.double(), is_dora, slots, bias)
    with pytest.raises(ValueError):
        dora_epilogue(y, delta, g, is_dora, slots, bias, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_sees_slot_changes():
    y0, delta0, g, is_dora, slots, bias = (x.cuda() for x in case(64, 6144, 1, torch.bfloat16))
    y, delta = y0.clone(), delta0.clone()
    dora_epilogue_triton(y, delta, g, is_dora, slots, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dora_epilogue_triton(y, delta, g, is_dora, slots, bias)
    for flags in ([1, 0, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]):
        is_dora.copy_(torch.tensor(flags, dtype=torch.int32))
        g.mul_(1.1)
        y.copy_(y0)
        delta.copy_(delta0)
        graph.replay()
        want_y, want_d = y0.clone(), delta0.clone()
        dora_epilogue_reference(want_y, want_d, g, is_dora, slots, bias)
        assert torch.allclose(y.float(), want_y.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        assert torch.equal(delta, want_d)

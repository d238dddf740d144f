"""Sliding windows and soft-capped scores in the Triton paged decode kernel, against the reference
(`paged_decode_attention_reference`) and the engine's torch path, plus the torch prefill path's
windowed masks against a dense per-sequence oracle.

Without CUDA the kernel runs in the Triton interpreter (tests/kernels/conftest.py); the
`@pytest.mark.gpu` case runs it compiled in bf16 at Gemma 2's 9B shape.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.attention.paged_attention import (
    DecodeConfig,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from lorafleet.worker.layers.attention import AttentionMetadata, paged_attention
from tests.kernels.test_paged_attention import DEVICE, TOLERANCE, decode_meta, gpu, make_case

# Contexts shorter than, equal to and longer than the windows; a padding row (0).
CONTEXTS = [1, 7, 8, 9, 33, 100, 0, 150]


@pytest.mark.parametrize("window", [1, 8, 37, None])
@pytest.mark.parametrize("softcap", [None, 0.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("config", [DecodeConfig(16, 1), DecodeConfig(32, 4), DecodeConfig(16, 8)],
                         ids=["one", "split4", "split8"])
def test_window_and_softcap_match_reference(window, softcap, config) -> None:
    # NaN fill: a read of any slot outside a sequence's window (or context) would show.
    q, kc, vc, tables, lens = make_case(11, CONTEXTS, 8, 2, 32, 16, torch.float32)
    scale = 32**-0.5 * 4  # large scores, so the cap bites
    out = paged_decode_attention(q, kc, vc, tables, lens, scale, config=config, window=window, softcap=softcap)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens, scale, window=window, softcap=softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


def test_the_window_and_the_cap_change_the_result() -> None:
    """The reference is not blind to either option (else the comparison above proves nothing)."""
    q, kc, vc, tables, lens = make_case(11, [100], 8, 2, 32, 16, torch.float32)
    plain = paged_decode_attention_reference(q, kc, vc, tables, lens, 0.7)
    assert (paged_decode_attention_reference(q, kc, vc, tables, lens, 0.7, window=8) - plain).abs().max() > 1e-2
    assert (paged_decode_attention_reference(q, kc, vc, tables, lens, 0.7, softcap=0.5) - plain).abs().max() > 1e-2


def test_window_reads_nothing_before_it() -> None:
    """Slots before the window hold NaN: the kernel must not even load them into a sum."""
    q, kc, vc, tables, lens = make_case(3, [70], 4, 2, 32, 16, torch.float32, fill=0.0)
    for t in range(70 - 8):
        kc[tables[0, t // 16], t % 16] = float("nan")
        vc[tables[0, t // 16], t % 16] = float("nan")
    for config in (DecodeConfig(16, 1), DecodeConfig(32, 2)):
        out = paged_decode_attention(q, kc, vc, tables, lens, 0.2, config=config, window=8)
        assert not out.isnan().any()


@pytest.mark.parametrize("softcap", [None, 0.5], ids=["plain", "softcap"])
def test_worker_decode_paths_agree(softcap) -> None:
    q, kc, vc, tables, lens = make_case(6, [1, 16, 37, 150, 64], 8, 2, 32, 16, torch.float32, fill=0.5)
    meta = decode_meta(tables, lens)
    torch_out = paged_attention(q, kc, vc, meta, 0.3, window=12, softcap=softcap)
    triton_out = paged_attention(q, kc, vc, meta, 0.3, backend="triton", window=12, softcap=softcap)
    torch.testing.assert_close(triton_out, torch_out, **TOLERANCE[torch.float32])


def dense_oracle(q, k, v, scale, window, softcap, start):
    """One sequence: queries at positions start.. over keys 0..; causal, windowed, capped."""
    n, ctx = q.shape[0], k.shape[0]
    s = torch.einsum("nhd,chd->hnc", q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(start, start + n).view(-1, 1)
    kpos = torch.arange(ctx).view(1, -1)
    seen = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    s = s.masked_fill(~seen, float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("hnc,chd->nhd", p, v.double().repeat_interleave(q.shape[1] // k.shape[1], 1))


@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.parametrize("softcap", [None, 0.5], ids=["plain", "softcap"])
def test_prefill_steps_honour_windows(window, softcap) -> None:
    """A prefill step mixing a fresh prompt, a chunk after a cached prefix and decode rows (grouped
    into padded calls and calls of one), each against a dense oracle."""
    torch.manual_seed(0)
    block, heads, kv_heads, dim = 8, 4, 2, 16
    seqs = [(30, 30), (12, 40), (1, 23), (1, 9), (3, 3)]  # (new tokens, context after the step)
    nblocks = sum(-(-c // block) for _, c in seqs)
    kc = torch.randn(nblocks + 1, block, kv_heads, dim)
    vc = torch.randn_like(kc)
    width = max(-(-c // block) for _, c in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    used = 0
    for i, (_, c) in enumerate(seqs):
        nb = -(-c // block)
        tables[i, :nb] = torch.arange(used, used + nb, dtype=torch.int32)
        used += nb
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, dim)
    meta = AttentionMetadata(
        query_lens=[n for n, _ in seqs], context_lens=[c for _, c in seqs], query_start=starts,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64), block_tables=tables,
        context_lens_t=torch.tensor([c for _, c in seqs], dtype=torch.int32), all_decode=False,
    )
    out = paged_attention(q, kc, vc, meta, 0.4, window=window, softcap=softcap)
    for i, (n, c) in enumerate(seqs):
        blocks = tables[i, : -(-c // block)].long()
        k, v = kc[blocks].flatten(0, 1)[:c], vc[blocks].flatten(0, 1)[:c]
        want = dense_oracle(q[starts[i] : starts[i] + n], k, v, 0.4, window, softcap, c - n)
        torch.testing.assert_close(out[starts[i] : starts[i] + n].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [4096, 100, None])
def test_bf16_gemma2_9b_shape(window) -> None:
    """bf16 on the GPU at Gemma 2 9B's attention shape (16 heads over 8 KV heads of 256), capped at 50."""
    q, kc, vc, tables, lens = make_case(1, [4500, 2000, 90, 1] * 8, 16, 8, 256, 16, torch.bfloat16, device=DEVICE)
    out = paged_decode_attention(q, kc, vc, tables, lens, 256**-0.5, window=window, softcap=50.0)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens, 256**-0.5, window=window, softcap=50.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

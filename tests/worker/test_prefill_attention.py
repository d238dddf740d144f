"""Prefill attention (`worker.attention.paged_attention` on steps that are not all decode): the
step's sequences batched into padded SDPA calls against an independent oracle, plain causal
attention over each sequence's full context computed with explicit softmax in float64."""

from __future__ import annotations

import math

import pytest
import torch

from lorafleet.worker.layers.attention import AttentionMetadata, group_prefill, paged_attention

BLOCK = 4


def oracle(q, keys, values, n, scale):
    """q `[n, H, D]` (the last n positions), keys/values `[ctx, KVH, D]` -> `[n, H, D]` in float64."""
    ctx, heads, kv_heads = keys.shape[0], q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    qpos = torch.arange(ctx - n, ctx).view(1, -1, 1)
    scores = scores.masked_fill(torch.arange(ctx).view(1, 1, -1) > qpos, -math.inf)
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def prefill_case(seed: int, query_lens: list[int], context_lens: list[int], heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 8, dtype=torch.float32):
    """Caches with every sequence's context in shuffled blocks; every other block holds NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-c // BLOCK) for c in context_lens]
    num_blocks = sum(blocks_per) + 3
    k_cache = torch.full((num_blocks, BLOCK, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(query_lens), max(blocks_per), dtype=torch.int32)
    keys, values = [], []
    for i, (ctx, nb) in enumerate(zip(context_lens, blocks_per)):
        ids = [order.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
        for t in range(ctx):
            k_cache[ids[t // BLOCK], t % BLOCK] = k[t]
            v_cache[ids[t // BLOCK], t % BLOCK] = v[t]
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_lens=query_lens, context_lens=context_lens, query_start=starts, slot_mapping=torch.zeros(0),
        block_tables=tables, context_lens_t=torch.tensor(context_lens, dtype=torch.int32), all_decode=False,
    )
    return q, k_cache, v_cache, meta, keys, values


@pytest.mark.parametrize("query_lens, context_lens", [
    ([5, 3, 7, 1], [5, 3, 7, 9]),          # new prompts of different lengths, and a decode row (cached 8)
    ([4, 6, 2], [10, 6, 13]),              # cached prefixes (chunked prefill), one fresh prompt
    ([16] * 6, [16] * 6),                  # equal prompts: one call
    ([3], [11]),                           # one sequence, with a prefix: the masked single path
    ([9], [9]),                            # one fresh prompt: SDPA's causal kernel
    ([1] * 5 + [140], [30, 7, 19, 4, 12, 140]),  # a mixed step: decode rows batched, a long prompt alone
])
def test_batched_prefill_matches_per_sequence_oracle(query_lens, context_lens) -> None:
    q, k_cache, v_cache, meta, keys, values = prefill_case(1, query_lens, context_lens)
    out = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert torch.isfinite(out).all()  # NaN in other sequences' blocks and the padding never leaks
    for i, n in enumerate(query_lens):
        start = meta.query_start[i]
        want = oracle(q[start : start + n], keys[i], values[i], n, 0.3)
        torch.testing.assert_close(out[start : start + n].double(), want, atol=1e-5, rtol=1e-5)
    assert meta.prefill_plan is not None  # made by the first layer, kept for the others
    assert sorted(i for g in meta.prefill_plan for i in g.seqs) == list(range(len(query_lens)))


def test_plan_is_reused_across_layers() -> None:
    q, k_cache, v_cache, meta, keys, values = prefill_case(2, [3, 5], [3, 5])
    first = paged_attention(q, k_cache, v_cache, meta, 0.5)
    plan = meta.prefill_plan
    again = paged_attention(q, k_cache, v_cache, meta, 0.5)
    assert meta.prefill_plan is plan and torch.equal(first, again)


def test_groups_respect_the_budget() -> None:
    # Sorted by context; a sequence that alone exceeds the budget is a group of one.
    assert group_prefill([4, 4, 4], [4, 4, 4], budget=1000) == [[0, 1, 2]]
    assert group_prefill([4, 200, 1], [4, 200, 900], budget=1 << 20) == [[1], [2, 0]]  # long query runs alone
    assert group_prefill([4, 4, 4], [4, 4, 4], budget=32) == [[0, 1], [2]]
    assert group_prefill([100, 2, 2], [100, 2, 2], budget=64) == [[1, 2], [0]]
    assert group_prefill([1, 64, 1], [30, 64, 20], budget=1 << 20) == [[2, 0, 1]]  # sorted by (new, context)
    assert group_prefill([1, 64, 1], [30, 64, 20], budget=3 * 64 * 64 - 1) == [[2, 0], [1]]
    # Long contexts: at most max_gather context tokens gathered per call.
    assert group_prefill([1] * 4, [30, 30, 30, 30], max_gather=64) == [[0, 1], [2, 3]]
    # 63 decode rows and a 128-token prompt: padding the rows to 128 queries would be waste.
    assert group_prefill([1] * 63 + [128], [300] * 63 + [128]) == [list(range(63)), [63]]
    groups = group_prefill([8, 1, 8, 1], [8, 40, 8, 40], budget=200)
    assert sorted(sum(groups, [])) == [0, 1, 2, 3]
    for g in groups:
        n, ctx = max([8, 1, 8, 1][i] for i in g), max([8, 40, 8, 40][i] for i in g)
        assert len(g) == 1 or len(g) * n * ctx <= 200


@pytest.mark.parametrize("seed", range(30))
def test_random_steps_under_any_grouping(seed: int, monkeypatch) -> None:
    """Random mixes of decode rows, fresh prompts and cached prefixes, GQA ratios 1-3, and random
    group limits (so calls of one, a few and all sequences all occur), against the oracle."""
    import random

    from lorafleet.worker.layers import attention

    r = random.Random(seed)
    limits = dict(budget=r.choice([64, 500, 5000, 1 << 22]), max_query=r.choice([4, 16, 128]),
                  max_gather=r.choice([40, 200, 1 << 16]))
    monkeypatch.setattr(attention, "group_prefill", lambda q, c, grouping=attention.group_prefill: grouping(q, c, **limits))
    query_lens, context_lens = [], []
    for _ in range(r.randint(2, 10)):
        kind = r.random()
        n = 1 if kind < 0.35 else r.randint(1, 40)
        query_lens.append(n)
        context_lens.append(r.randint(1, 70) if n == 1 else n if kind < 0.7 else n + r.randint(1, 50))
    query_lens[0] = max(2, query_lens[0])  # not an all-decode step
    context_lens[0] = max(context_lens[0], query_lens[0])
    kv_heads = r.choice([1, 2, 4])
    q, k_cache, v_cache, meta, keys, values = prefill_case(seed, query_lens, context_lens, kv_heads * r.choice([1, 2, 3]),
                                                           kv_heads)
    out = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert torch.isfinite(out).all()
    for i, n in enumerate(query_lens):
        start = meta.query_start[i]
        torch.testing.assert_close(out[start : start + n].double(), oracle(q[start : start + n], keys[i], values[i], n, 0.3),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.float16, 1e-2), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("seed", range(4))
def test_batched_prefill_on_cuda(dtype, tol, seed: int) -> None:
    """The same steps on CUDA at the seed model's head shape (32 query heads over 8 KV heads, dim
    128), where SDPA picks its fused kernels (masked calls and the causal one): within `tol` of the
    float64 oracle (bf16 keeps 8 mantissa bits; values and outputs are O(1))."""
    import random

    r = random.Random(seed)
    query_lens = [r.choice([1, 1, 7, 16, 33, 128]) for _ in range(12)] + [200]
    context_lens = [n if r.random() < 0.5 and n > 1 else n + r.randint(1, 300) for n in query_lens]
    q, k_cache, v_cache, meta, keys, values = prefill_case(seed, query_lens, context_lens, 32, 8, 128, dtype)
    meta.block_tables, meta.context_lens_t = meta.block_tables.cuda(), meta.context_lens_t.cuda()
    scale = 128**-0.5
    out = paged_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), meta, scale).cpu()
    assert torch.isfinite(out).all()
    from lorafleet.worker.layers import attention

    if attention.PREFILL_BATCH_QUERY > 0:  # (LORAFLEET_PREFILL_BATCH_QUERY=0 runs one call per sequence)
        assert len(meta.prefill_plan) < len(query_lens)  # batched: fewer calls than sequences
    for i, n in enumerate(query_lens):
        start = meta.query_start[i]
        torch.testing.assert_close(out[start : start + n].double(),
                                   oracle(q[start : start + n], keys[i], values[i], n, scale), atol=tol, rtol=tol)


def test_cpu_attention_leaves_the_sdpa_flags_alone(monkeypatch) -> None:
    """On the CPU the cuDNN flag (a CUDA backend's) is neither read nor changed."""
    from lorafleet.worker.layers import attention

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        q, k_cache, v_cache, meta, _, _ = prefill_case(0, [200, 9, 3], [200, 9, 11])
        paged_attention(q, k_cache, v_cache, meta, 0.3)
        assert seen == [True, True] and torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("query_lens, context_lens", [([200], [200]), ([50], [120]), ([1], [37])])
def test_one_sequence_step_on_cuda(query_lens, context_lens) -> None:
    """A step of one sequence returns SDPA's output as it comes (no copy into a new tensor): right
    against the oracle at the seed model's head shape, fresh or with a cached prefix."""
    q, k_cache, v_cache, meta, keys, values = prefill_case(2, query_lens, context_lens, 32, 8, 128, torch.bfloat16)
    meta.block_tables, meta.context_lens_t = meta.block_tables.cuda(), meta.context_lens_t.cuda()
    scale = 128**-0.5
    out = paged_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), meta, scale)
    assert out.shape == q.shape
    n = query_lens[0]
    torch.testing.assert_close(out.cpu().double(), oracle(q, keys[0], values[0], n, scale), atol=4e-2, rtol=4e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cudnn_before", [True, False])
def test_cudnn_sdpa_is_off_during_the_call_only(cudnn_before: bool, monkeypatch) -> None:
    """cuDNN's SDPA (a graph built per new shape, ~1.8 ms of host time a call) is off while the
    attention runs and set back as it was afterwards, also when SDPA raises."""
    from lorafleet.worker.layers import attention

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if kwargs.get("scale") == 0.5 and len(seen) == 4:  # the second call's padded group
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    try:
        # a long fresh prompt alone (causal, no mask), two short rows padded into one masked call
        q, k_cache, v_cache, meta, keys, values = prefill_case(0, [200, 9, 3], [200, 9, 11], 32, 8, 128, torch.bfloat16)
        meta.block_tables, meta.context_lens_t = meta.block_tables.cuda(), meta.context_lens_t.cuda()
        paged_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), meta, 0.3)
        assert len(seen) == 2 and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before
        with pytest.raises(RuntimeError, match="boom"):
            paged_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), meta, 0.5)
        assert len(seen) == 4 and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)

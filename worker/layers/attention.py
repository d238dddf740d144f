"""Paged attention over a block-table KV cache.

Each layer's cache is `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and for values. A
sequence's tokens live in the blocks its block table names, in order; `slot_mapping` says where each
new token's key and value are written (`block * block_size + offset`).

Backends for decode-only steps (`EngineConfig.attention_backend`): "torch" (default) gathers each
sequence's blocks into a tensor padded to the step's longest context and calls SDPA; "triton" runs
`lorafleet.kernels.attention.paged_attention`, whose shapes do not depend on the context lengths (what CUDA
graphs need; off by default until its GPU tests pass on the H200). Prefill chunks always use torch.
The model reads the same switch for its elementwise ops: "triton" also replaces `write_kv` and the
RoPE, norm and SiLU torch ops with the fused kernels of `lorafleet.kernels.layers.rms_norm`, `.rope_kv` and
`.silu_mul`.

Two per-layer options: `window` (a sliding window: the query at position p sees keys p - window + 1
.. p, transformers' sliding-window mask; Mistral, Gemma 2/3, Qwen with use_sliding_window, Phi-3)
and `softcap` (Gemma 2's attention logit soft-capping: scores -> softcap · tanh(scores / softcap)
before the softmax, which SDPA cannot do: those layers run an explicit softmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lorafleet.kernels.envs import interpreting
from lorafleet.worker import envs
from lorafleet.worker.config import ConfigError

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    """Per step, shared by every layer. Sequences are laid out back to back in the token dimension."""

    query_lens: list[int]  # new tokens per sequence (host)
    context_lens: list[int]  # tokens per sequence after this step, cached + new (host)
    query_start: list[int]  # offsets of each sequence's new tokens, len = num_seqs + 1 (host)
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    context_lens_t: torch.Tensor  # [num_seqs] int32 on device
    all_decode: bool  # every sequence has exactly one new token
    # A CUDA-graph step (`worker/engine/cuda_graphs.py`): shapes follow the table width, never the host lists.
    fixed_shapes: bool = False
    # Prefill steps: how the sequences are batched into SDPA calls (`plan_prefill`), made by the
    # first layer and reused by the others.
    prefill_plan: list[PrefillGroup] | None = None
    # The same for each sliding window the model's layers use (their masks differ).
    window_plans: dict[int, list[PrefillGroup]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' keys and values. k, v: `[T, kv_heads, head_dim]`."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """Check a backend name against the device; the Triton kernel runs on CPU only in the interpreter."""
    if name == "auto":  # the Triton kernel on CUDA (validated on the H200, 2026-11-30), torch on CPU
        return "triton" if device.type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend must be auto|{'|'.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise ConfigError("the triton attention backend needs --device cuda (or TRITON_INTERPRET=1)")
    return name


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "torch",
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (within `window`
    tokens when given; scores soft-capped at `softcap` when given).

    q: `[T, heads, head_dim]` -> `[T, heads, head_dim]`. Decode-only steps run as one batch through
    `decode_attention`. Other steps (prefill chunks) batch their sequences into padded SDPA calls
    with an offset causal mask (`plan_prefill`, once per step); a sequence too long to pad others to
    runs alone, with SDPA's mask-free causal kernel when nothing of it is cached. The output need not
    be contiguous: a step of one sequence returns SDPA's output as it comes (on CUDA its fused
    kernels write it token-major, so the caller's reshape costs no copy).
    """
    if meta.all_decode:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale, backend,
                                max_context=None if meta.fixed_shapes else max(meta.context_lens),
                                window=window, softcap=softcap)
    if window is None:
        if meta.prefill_plan is None:
            meta.prefill_plan = plan_prefill(meta, k_cache.shape[1], q.device)
        plan = meta.prefill_plan
    else:
        if window not in meta.window_plans:
            meta.window_plans[window] = plan_prefill(meta, k_cache.shape[1], q.device, window)
        plan = meta.window_plans[window]
    if len(plan) == 1 and plan[0].dst is None and plan[0].n_max == q.shape[0]:  # SDPA's output as it comes
        return _one_sequence(q, k_cache, v_cache, meta, plan[0], scale, softcap)
    out = torch.empty_like(q)
    for group in plan:
        if group.dst is None:
            start = meta.query_start[group.seqs[0]]
            out[start : start + group.n_max] = _one_sequence(q, k_cache, v_cache, meta, group, scale, softcap)
        else:
            _padded_batch(q, k_cache, v_cache, group, scale, out, softcap)
    return out


# A prefill step's sequences with at most PREFILL_BATCH_QUERY new tokens share SDPA calls, each
# padded call under PREFILL_BATCH_PAIRS (query, key) pairs per head (the math backend materialises
# that many scores). These are the decode rows of mixed steps and short prompts, where a call per
# sequence and layer costs more host time than the attention itself. Longer query runs go alone:
# a masked padded call is slower than SDPA's causal kernel on one fresh prompt (on CPU, a batch of
# 64 512-token prompts: 138 ms one by one, 183 ms batched; 64 32-token prompts: 12.4 -> 8.4 ms).
# LORAFLEET_PREFILL_BATCH_QUERY=0 turns batching off (one call per sequence, for A/B runs).
PREFILL_BATCH_QUERY = envs.PREFILL_BATCH_QUERY
PREFILL_BATCH_PAIRS = 1 << 22
PREFILL_SMALL_CALL = 1 << 16  # padded pairs below which padding waste does not matter
# And at most this many context tokens gathered from the cache per call (count × longest context):
# the gathered K and V are a copy, 256 MiB per layer at the seed shape (8 KV heads of 128, bf16).
PREFILL_GATHER_TOKENS = 1 << 16


@dataclass(slots=True)
class PrefillGroup:
    """Sequences of a prefill step attended in one padded SDPA call, or one sequence on its own
    (then `src`, `dst` and `key_invalid` are None, `tables` is its `[blocks]` and `mask` its
    `[n, ctx]`, or None when nothing of it is cached). Tensors are on the model's device, made once
    a step rather than in every layer."""

    seqs: list[int]
    n_max: int = 0  # padded new tokens per sequence (alone: its new tokens)
    ctx_max: int = 0  # padded context (alone: its context)
    src: torch.Tensor | None = None  # [tokens] int64: the group's rows of q / out
    dst: torch.Tensor | None = None  # [tokens] int64: the same rows in the padded [B * n_max] layout
    tables: torch.Tensor | None = None  # [B, blocks] int64: block tables cut to ctx_max (alone: [blocks])
    mask: torch.Tensor | None = None  # [B, n_max, ctx_max] bool: query sees key (alone: [n, ctx] or None)
    key_invalid: torch.Tensor | None = None  # [B, ctx_max, 1, 1] bool: key past the sequence's context


def group_prefill(
    query_lens: list[int],
    context_lens: list[int],
    budget: int = PREFILL_BATCH_PAIRS,
    max_query: int = PREFILL_BATCH_QUERY,
    max_gather: int = PREFILL_GATHER_TOKENS,
) -> list[list[int]]:
    """Sequences with more than `max_query` new tokens alone; the others sorted by new tokens,
    then context, and cut into runs whose padded call (count × longest new tokens × longest
    context) stays within `budget` and, past small calls, within twice the pairs its sequences
    need (so a prompt's chunk does not pad a group of decode rows to its length), and whose
    gathered context (count × longest context) stays within `max_gather` tokens."""
    groups: list[list[int]] = [[i] for i, n in enumerate(query_lens) if n > max_query]
    current: list[int] = []
    n_max = ctx_max = needed = 0
    short = [i for i, n in enumerate(query_lens) if n <= max_query]
    for i in sorted(short, key=lambda i: (query_lens[i], context_lens[i])):  # decode rows apart from prompts
        n, ctx = max(n_max, query_lens[i]), max(ctx_max, context_lens[i])
        need = needed + query_lens[i] * context_lens[i]
        padded = (len(current) + 1) * n * ctx
        gathered = (len(current) + 1) * ctx
        if current and (padded > budget or gathered > max_gather or (padded > PREFILL_SMALL_CALL and padded > 2 * need)):
            groups.append(current)
            current, n, ctx, need = [], query_lens[i], context_lens[i], query_lens[i] * context_lens[i]
        current.append(i)
        n_max, ctx_max, needed = n, ctx, need
    if current:
        groups.append(current)
    return groups


def plan_prefill(
    meta: AttentionMetadata, block_size: int, device: torch.device, window: int | None = None
) -> list[PrefillGroup]:
    """Host work done once per step (and window): groups, their row indices and masks, moved to the device."""
    plan = []
    for seqs in group_prefill(meta.query_lens, meta.context_lens):
        if len(seqs) == 1:
            plan.append(_alone(meta, seqs[0], block_size, device, window))
            continue
        n_lens = torch.tensor([meta.query_lens[i] for i in seqs])
        ctxs = torch.tensor([meta.context_lens[i] for i in seqs])
        n_max, ctx_max = int(n_lens.max()), int(ctxs.max())
        src = torch.cat([torch.arange(meta.query_start[i], meta.query_start[i] + meta.query_lens[i]) for i in seqs])
        dst = torch.cat([b * n_max + torch.arange(meta.query_lens[i]) for b, i in enumerate(seqs)])
        # Query j of sequence b sits at absolute position ctx_b - n_b + j and sees keys 0..that
        # position; padding rows repeat the last query (their output is dropped).
        j = torch.minimum(torch.arange(n_max).unsqueeze(0), (n_lens - 1).unsqueeze(1))  # [B, n_max]
        qpos = (ctxs - n_lens).unsqueeze(1) + j
        kpos = torch.arange(ctx_max)
        sees = kpos.view(1, 1, -1) <= qpos.unsqueeze(2)
        if window is not None:
            sees &= kpos.view(1, 1, -1) > qpos.unsqueeze(2) - window
        rows = torch.tensor(seqs, device=meta.block_tables.device)
        tables = meta.block_tables.index_select(0, rows)[:, : (ctx_max + block_size - 1) // block_size].long()
        plan.append(PrefillGroup(
            seqs=seqs, n_max=n_max, ctx_max=ctx_max, src=src.to(device), dst=dst.to(device), tables=tables,
            mask=sees.to(device),
            key_invalid=(kpos.unsqueeze(0) >= ctxs.unsqueeze(1)).view(len(seqs), ctx_max, 1, 1).to(device),
        ))
    return plan


def _alone(meta: AttentionMetadata, i: int, block_size: int, device: torch.device, window: int | None = None
           ) -> PrefillGroup:
    """Sequence i's group of one: its blocks, and its mask where part of it is cached (or out of
    its window)."""
    n, ctx = meta.query_lens[i], meta.context_lens[i]
    tables = meta.block_tables[i, : (ctx + block_size - 1) // block_size].to(device, torch.int64)
    mask = None  # no cached prefix: plain causal attention (SDPA's flash kernel takes no mask)
    windowed = window is not None and ctx > window
    if n != ctx or windowed:  # query j sits at absolute position ctx - n + j and sees keys 0..that position
        qpos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
        kpos = torch.arange(ctx, device=device).unsqueeze(0)
        mask = kpos <= qpos  # [n, ctx]
        if windowed:
            mask &= kpos > qpos - window
    return PrefillGroup(seqs=[i], n_max=n, ctx_max=ctx, tables=tables, mask=mask)


def _padded_batch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: PrefillGroup, scale: float, out: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """One SDPA call for the group's sequences, padded to its longest query run and context."""
    heads, head_dim = q.shape[1], q.shape[2]
    batch = len(group.seqs)
    qp = q.new_zeros(batch * group.n_max, heads, head_dim)
    qp.index_copy_(0, group.dst, q.index_select(0, group.src))
    k = k_cache[group.tables].flatten(1, 2)[:, : group.ctx_max]  # [B, ctx_max, kv_heads, head_dim]
    v = v_cache[group.tables].flatten(1, 2)[:, : group.ctx_max]
    # Keys past a sequence's context come from other sequences' blocks (or padding's block 0):
    # masked, but zeroed too (in the gathered copy), so a NaN left there cannot reach this
    # sequence through 0 · NaN.
    k.masked_fill_(group.key_invalid, 0)
    v.masked_fill_(group.key_invalid, 0)
    res = _attend(qp.view(batch, group.n_max, heads, head_dim), k, v, group.mask, scale, softcap)
    out.index_copy_(0, group.src, res.reshape(batch * group.n_max, heads, head_dim).index_select(0, group.dst))


def _one_sequence(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, group: PrefillGroup,
    scale: float, softcap: float | None = None,
) -> torch.Tensor:
    """A group of one -> its rows of the output, `[n, heads, head_dim]` (strided as SDPA returns them)."""
    n, ctx, start = group.n_max, group.ctx_max, meta.query_start[group.seqs[0]]
    k = k_cache[group.tables].flatten(0, 1)[:ctx]  # [ctx, kv_heads, head_dim]
    v = v_cache[group.tables].flatten(0, 1)[:ctx]
    return _attend(q[start : start + n].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), group.mask, scale, softcap)[0]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    backend: str = "torch",
    max_context: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence: q `[B, heads, head_dim]` -> `[B, heads, head_dim]`.

    block_tables: `[B, max_blocks]` int32; context_lens: `[B]` int32 on q's device. `max_context`
    (host) trims the torch path's gather to the longest context; without it the torch path pads to
    the table width. The triton path never needs it: its shapes depend on the table width only.
    """
    if backend == "triton":
        from lorafleet.kernels.attention.paged_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=window,
                                      softcap=softcap)
    block_size = k_cache.shape[1]
    max_ctx = block_tables.shape[1] * block_size if max_context is None else max_context
    nblocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[:, :nblocks].long()  # [B, nblocks]
    k = k_cache[tables].flatten(1, 2)[:, :max_ctx]  # [B, max_ctx, kv_heads, head_dim]
    v = v_cache[tables].flatten(1, 2)[:, :max_ctx]
    positions = torch.arange(max_ctx, device=q.device).unsqueeze(0)
    mask = positions < context_lens.unsqueeze(1)  # [B, max_ctx]
    if window is not None:
        mask &= positions >= context_lens.unsqueeze(1) - window
    return _attend(q.unsqueeze(1), k, v, mask.unsqueeze(1), scale, softcap).squeeze(1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """`_sdpa`, or with soft-capped scores an explicit softmax (fp32, as transformers' eager
    attention), shapes as `_sdpa`'s."""
    if softcap is None:
        return _sdpa(q, k, v, mask, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    k = k.to(q.dtype).repeat_interleave(heads // kv_heads, dim=2)
    v = v.to(q.dtype).repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bnhd,bchd->bhnc", q, k) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:  # causal, n == ctx
        n = q.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if mask.dim() == 2:  # [n, ctx]: one sequence
        mask = mask.unsqueeze(0)
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhnc,bchd->bnhd", probs, v)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q `[B, n, H, D]`, k/v `[B, ctx, KVH, D]`, mask `[B or 1, n, ctx]` -> `[B, n, H, D]` (GQA).

    mask None: causal, query j seeing keys 0..j (n == ctx)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    grouped = heads != kv_heads
    if grouped and not _SDPA_GQA:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    extra = {"enable_gqa": True} if grouped and _SDPA_GQA else {}
    # cuDNN's SDPA builds a graph per new shape, and decode changes the context length every step:
    # about 1.8 ms of host time per call on an H200. The other CUDA backends have no such cost.
    # Turned off around the call by its flag alone (the other backends follow the process's flags,
    # all on by default): torch's `sdpa_kernel` context costs 29 µs of host time a call on the H200
    # machine, more than a layer's attention kernel on a 512-token prompt (22 µs). The flag is the
    # process's: one thread runs the model (the engine's).
    no_cudnn = q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()
    if no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=None if mask is None else mask.unsqueeze(1) if mask.dim() == 3 else mask,
            is_causal=mask is None, scale=scale, **extra,
        )
    finally:
        if no_cudnn:
            torch.backends.cuda.enable_cudnn_sdp(True)
    return out.transpose(1, 2)


def _sdpa_supports_gqa() -> bool:
    # torch >= 2.5 groups query heads over shared key/value heads without copying them.
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: try it
        try:
            F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                           enable_gqa=True)
            return True
        except TypeError:
            return False


_SDPA_GQA = _sdpa_supports_gqa()

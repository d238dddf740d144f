"""Paged attention over a block-table KV cache.

Each layer's cache is `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and for values. A
sequence's tokens live in the blocks its block table names, in order; `slot_mapping` says where each
new token's key and value are written (`block * block_size + offset`).

Backends for decode-only steps (`EngineConfig.attention_backend`): "torch" (default) gathers each
sequence's blocks into a tensor padded to the step's longest context and calls SDPA; "triton" runs
`lorafleet.kernels.paged_attention`, whose shapes do not depend on the context lengths (what CUDA
graphs need; off by default until its GPU tests pass on the H200). Prefill chunks always use torch.
The model reads the same switch for its elementwise ops: "triton" also replaces `write_kv` and the
RoPE, norm and SiLU torch ops with the fused kernels of `lorafleet.kernels.fused_ops`.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lorafleet.worker.config import ConfigError

ATTENTION_BACKENDS = ("torch", "triton")
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    # A CUDA-graph step (`worker/cuda_graphs.py`): shapes follow the table width, never the host lists.
    fixed_shapes: bool = False

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
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("the triton attention backend needs --device cuda (or TRITON_INTERPRET=1)")
    return name


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "torch",
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context.

    q: `[T, heads, head_dim]` -> `[T, heads, head_dim]`. Decode-only steps run as one batch through
    `decode_attention`; other sequences (prefill chunks) run one at a time with an offset causal mask.
    """
    if meta.all_decode:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens_t, scale, backend,
                                max_context=None if meta.fixed_shapes else max(meta.context_lens))
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        start = meta.query_start[i]
        blocks = meta.block_tables[i, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # [ctx, kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        qi = q[start : start + n]
        if n == ctx:  # no cached prefix: plain causal attention (SDPA's flash kernel takes no mask)
            out[start : start + n] = _sdpa(qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, scale)[0]
            continue
        # Query j sits at absolute position ctx - n + j and sees keys 0..that position.
        qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
        mask = kpos <= qpos  # [n, ctx]
        out[start : start + n] = _sdpa(qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale)[0]
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    backend: str = "torch",
    max_context: int | None = None,
) -> torch.Tensor:
    """One query token per sequence: q `[B, heads, head_dim]` -> `[B, heads, head_dim]`.

    block_tables: `[B, max_blocks]` int32; context_lens: `[B]` int32 on q's device. `max_context`
    (host) trims the torch path's gather to the longest context; without it the torch path pads to
    the table width. The triton path never needs it: its shapes depend on the table width only.
    """
    if backend == "triton":
        from lorafleet.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    block_size = k_cache.shape[1]
    max_ctx = block_tables.shape[1] * block_size if max_context is None else max_context
    nblocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[:, :nblocks].long()  # [B, nblocks]
    k = k_cache[tables].flatten(1, 2)[:, :max_ctx]  # [B, max_ctx, kv_heads, head_dim]
    v = v_cache[tables].flatten(1, 2)[:, :max_ctx]
    positions = torch.arange(max_ctx, device=q.device).unsqueeze(0)
    mask = (positions < context_lens.unsqueeze(1)).unsqueeze(1)  # [B, 1, max_ctx]
    return _sdpa(q.unsqueeze(1), k, v, mask, scale).squeeze(1)


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
    # measured on an H200, 1.8 ms of host time per call. The other CUDA backends have no such cost.
    ctx = sdpa_kernel(_CUDA_BACKENDS) if q.is_cuda else nullcontext()
    with ctx:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=None if mask is None else mask.unsqueeze(1) if mask.dim() == 3 else mask,
            is_causal=mask is None, scale=scale, **extra,
        )
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

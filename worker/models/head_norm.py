"""q and k normed per head before RoPE (Qwen3, Gemma 3): one RMSNorm over each head's
`[head_dim]` row of q and of k, between the projection (its LoRA added) and the rotation."""

from __future__ import annotations

import torch

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.worker.models.llama import Rotary, rms_norm


class HeadNormAttention:
    """Mixed in before a `LlamaModel` subclass whose layers hold `q_norm`/`k_norm` weights.

    `head_norm` is the family's RMSNorm (Llama's `w · x̂`, or Gemma's `(1 + w) · x̂` in fp32);
    `NORM_OFFSET` tells the Triton RMSNorm which (`offset`: Gemma's)."""

    NORM_OFFSET = False

    @staticmethod
    def head_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def _qkv_for_rope(
        self, x: torch.Tensor, layer: int, lora_meta: LoraMeta | None, graph: bool
    ) -> tuple[torch.Tensor, None]:
        """The fused path: q and k normed per head (the Triton RMSNorm over `[T·heads, head_dim]`
        rows) between the projection, its LoRA added, and the fused RoPE/KV write."""
        from lorafleet.kernels.layers.rms_norm import rms_norm as fused_rms_norm

        c, w, p, off = self.config, self.weights, f"layers.{layer}.", self.NORM_OFFSET  # type: ignore[attr-defined]
        qkv = self._linear(x, layer, "qkv_proj", lora_meta, graph)  # type: ignore[attr-defined]  # [T, q_size + 2 kv_size]
        t, qs, ks = qkv.shape[0], c.q_size, c.kv_size
        q = fused_rms_norm(qkv[:, :qs].reshape(-1, c.head_dim), w[p + "q_norm"], c.rms_norm_eps, offset=off)
        k = fused_rms_norm(qkv[:, qs : qs + ks].reshape(-1, c.head_dim), w[p + "k_norm"], c.rms_norm_eps, offset=off)
        return torch.cat([q.view(t, qs), k.view(t, ks), qkv[:, qs + ks :]], dim=-1), None

    def _rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w, p = self.config, self.weights, f"layers.{layer}."  # type: ignore[attr-defined]
        q = self.head_norm(q.reshape(-1, c.num_heads, c.head_dim), w[p + "q_norm"], c.rms_norm_eps)
        k = self.head_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), w[p + "k_norm"], c.rms_norm_eps)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)

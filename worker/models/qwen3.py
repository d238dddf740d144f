"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k before RoPE.

Checkpoint names: Llama's, plus `self_attn.q_norm.weight` and `self_attn.k_norm.weight` per layer
(`[head_dim]` each, Llama-style `w · x̂`). Adapters target q/k/v/o/gate/up/down_proj as on Llama.
No attention bias (`attention_bias: false`); sliding windows only with `use_sliding_window`.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.worker.models.llama import LlamaModel, Rotary, _take, rms_norm


class Qwen3Model(LlamaModel):
    def _qkv_for_rope(
        self, x: torch.Tensor, layer: int, lora_meta: LoraMeta | None, graph: bool
    ) -> tuple[torch.Tensor, None]:
        """The fused path: q and k normed per head (the Triton RMSNorm over `[T·heads, head_dim]`
        rows) between the projection, its LoRA added, and the fused RoPE/KV write."""
        from lorafleet.kernels.layers.rms_norm import rms_norm as fused_rms_norm

        c, w, p = self.config, self.weights, f"layers.{layer}."
        qkv = self._linear(x, layer, "qkv_proj", lora_meta, graph)  # [T, q_size + 2 kv_size]
        t, qs, ks = qkv.shape[0], c.q_size, c.kv_size
        q = fused_rms_norm(qkv[:, :qs].reshape(-1, c.head_dim), w[p + "q_norm"], c.rms_norm_eps)
        k = fused_rms_norm(qkv[:, qs : qs + ks].reshape(-1, c.head_dim), w[p + "k_norm"], c.rms_norm_eps)
        return torch.cat([q.view(t, qs), k.view(t, ks), qkv[:, qs + ks :]], dim=-1), None

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "q_norm"] = _take(pending, p + "self_attn.q_norm.weight")
        w[p + "k_norm"] = _take(pending, p + "self_attn.k_norm.weight")

    def _rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w, p = self.config, self.weights, f"layers.{layer}."
        q = rms_norm(q.reshape(-1, c.num_heads, c.head_dim), w[p + "q_norm"], c.rms_norm_eps)
        k = rms_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), w[p + "k_norm"], c.rms_norm_eps)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)

"""Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`): Gemma 2's layer with

- an RMSNorm over each head of q and k before RoPE (`self_attn.q_norm`, `self_attn.k_norm`,
  Gemma's `1 + w` weights);
- local (sliding-window) and global layers (`layer_types`, or every `sliding_window_pattern`-th
  layer global) with their own RoPE bases: `rope_local_base_freq` (transformers 5:
  `rope_parameters.sliding_attention`) on local layers, `rope_theta` and its scaling
  (`rope_parameters.full_attention`) on global ones;
- usually no soft-capping (the config's caps are honoured when set).

Adapters target the same modules as Llama's. The multimodal `Gemma3ForConditionalGeneration`
(model_type `gemma3`) is refused: serve its text model.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.worker.models.gemma2 import Gemma2Model, gemma_rms_norm
from lorafleet.worker.models.llama import Rotary, _take


class Gemma3Model(Gemma2Model):
    def __init__(self, config, device, dtype, max_positions: int) -> None:
        super().__init__(config, device, dtype, max_positions)
        self.rotaries.append(Rotary(config, max_positions, device, local=True))

    def _rotary_index(self, layer: int) -> int:
        types = self.config.layer_types
        return 1 if types and types[layer] == "sliding_attention" else 0

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "q_norm"] = 1.0 + _take(pending, p + "self_attn.q_norm.weight").float()
        w[p + "k_norm"] = 1.0 + _take(pending, p + "self_attn.k_norm.weight").float()
        w[p + "q_norm_fused"], w[p + "k_norm_fused"] = w[p + "q_norm"].to(self.dtype), w[p + "k_norm"].to(self.dtype)

    def _qkv_for_rope(
        self, x: torch.Tensor, layer: int, lora_meta: LoraMeta | None, graph: bool
    ) -> tuple[torch.Tensor, None]:
        """The fused path: q and k normed per head (the Triton RMSNorm over `[T·heads, head_dim]`
        rows) between the projection, its LoRA added, and the fused RoPE/KV write."""
        from lorafleet.kernels.layers.rms_norm import rms_norm as fused_rms_norm

        c, w, p = self.config, self.weights, f"layers.{layer}."
        qkv = self._linear(x, layer, "qkv_proj", lora_meta, graph)  # [T, q_size + 2 kv_size]
        t, qs, ks = qkv.shape[0], c.q_size, c.kv_size
        q = fused_rms_norm(qkv[:, :qs].reshape(-1, c.head_dim), w[p + "q_norm_fused"], c.rms_norm_eps)
        k = fused_rms_norm(qkv[:, qs : qs + ks].reshape(-1, c.head_dim), w[p + "k_norm_fused"], c.rms_norm_eps)
        return torch.cat([q.view(t, qs), k.view(t, ks), qkv[:, qs + ks :]], dim=-1), None

    def _rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w, p = self.config, self.weights, f"layers.{layer}."
        q = gemma_rms_norm(q.reshape(-1, c.num_heads, c.head_dim), w[p + "q_norm"], c.rms_norm_eps)
        k = gemma_rms_norm(k.reshape(-1, c.num_kv_heads, c.head_dim), w[p + "k_norm"], c.rms_norm_eps)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)

"""Gemma 2: the Llama projections with Gemma's layer.

What differs from Llama:
- the embedding is scaled by sqrt(hidden) (in the weights' dtype, as transformers does);
- RMSNorm weights are offsets: x̂ · (1 + w), computed in fp32 and cast after;
- four norms a layer: input, post-attention (on the attention's output, before the residual add),
  pre-feedforward and post-feedforward (on the MLP's output, before the residual add);
- the MLP's activation is GELU with the tanh approximation (`gelu_pytorch_tanh`);
- scores are scaled by `query_pre_attn_scalar`^-1/2 and soft-capped (`attn_logit_softcapping`),
  the final logits soft-capped too (`final_logit_softcapping`);
- layers alternate a sliding window (`layer_types`: even layers local) and full attention;
- the lm_head is the embedding (tied).

Checkpoint names per layer: `self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
`post_feedforward_layernorm`. Adapters target the same modules as Llama's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.worker.layers.attention import AttentionMetadata, paged_attention, write_kv
from lorafleet.worker.models.llama import LlamaModel, Rotary, _take

NORMS = ("in_norm", "post_norm", "pre_ff_norm", "post_ff_norm")


def gemma_rms_norm(x: torch.Tensor, one_plus_w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: (x̂ · (1 + w)) in fp32, then x's dtype; `one_plus_w` is fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * one_plus_w).to(x.dtype)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh") if name == "gelu_pytorch_tanh" else F.silu(x)


class Gemma2Model(LlamaModel):
    """On the Triton backend the layer runs `_layers_fused`: Llama's fused RoPE/KV-write and
    RMSNorm kernels with the `1 + w` factors in the model's dtype (in fp32 the same numbers as
    transformers' fp32 norm; in bf16 the factor multiplies after the cast, within its rounding)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rotaries: list[Rotary] = [self.rotary]  # Gemma 3 adds its local layers' tables
        # sqrt(hidden) rounded to the weights' dtype first, as transformers scales the embedding.
        self.embed_scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype))

    def _rotary_index(self, layer: int) -> int:
        return 0

    def load_weights(self, named) -> None:
        super().load_weights(named)
        self.weights["norm"] = 1.0 + self.weights["norm"].float()
        self.weights["norm_fused"] = self.weights["norm"].to(self.dtype)

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "pre_ff_norm"] = _take(pending, p + "pre_feedforward_layernorm.weight")
        w[p + "post_ff_norm"] = _take(pending, p + "post_feedforward_layernorm.weight")
        for n in NORMS:  # offsets -> the factors they stand for, in fp32 (and the model's dtype for the kernels)
            w[p + n] = 1.0 + w[p + n].float()
            w[p + n + "_fused"] = w[p + n].to(self.dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights["embed"]) * self.embed_scale

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits, soft-capped when the config says so."""
        logits = F.linear(h, self.weights["lm_head"])
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layers_torch(
        self,
        h: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora_meta: LoraMeta | None,
        logits_indices: torch.Tensor,
        graph: bool,
    ) -> torch.Tensor:
        c, w = self.config, self.weights
        eps = c.rms_norm_eps
        tables = [r.at(positions, h.dtype) for r in self.rotaries]  # (cos, sin) per RoPE base
        for i in range(c.num_layers):
            p = f"layers.{i}."
            x = gemma_rms_norm(h, w[p + "in_norm"], eps)
            q, k, v = self._linear(x, i, "qkv_proj", lora_meta, graph).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q, k = self._rope_qk(q, k, i, *tables[self._rotary_index(i)])
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, attn, c.attention_scale, self.attention_backend,
                                window=c.window(i), softcap=c.attn_logit_softcapping).reshape(-1, c.q_size)
            h = h + gemma_rms_norm(self._linear(o, i, "o_proj", lora_meta, graph), w[p + "post_norm"], eps)
            x = gemma_rms_norm(h, w[p + "pre_ff_norm"], eps)
            gate, up = self._linear(x, i, "gate_up_proj", lora_meta, graph).chunk(2, dim=-1)
            down = self._linear(activation(c.hidden_act, gate) * up, i, "down_proj", lora_meta, graph)
            h = h + gemma_rms_norm(down, w[p + "post_ff_norm"], eps)
        return gemma_rms_norm(h.index_select(0, logits_indices), w["norm"], eps)

    def _layers_fused(
        self,
        h: torch.Tensor,  # [T, hidden], the residual stream: updated in place
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora_meta: LoraMeta | None,
        logits_indices: torch.Tensor,
        graph: bool,
    ) -> torch.Tensor:
        """The same layer with the Triton row kernels: qkv linear -> rope_write_kv -> attention ->
        o linear -> rms_norm (post-attention) -> add_rms_norm (residual, pre-feedforward) -> gate_up
        linear -> GELU-tanh · up -> down linear -> rms_norm (post-feedforward) -> add_rms_norm
        (residual, the next layer's input norm or the final norm)."""
        from lorafleet.kernels.layers.rms_norm import add_rms_norm
        from lorafleet.kernels.layers.rms_norm import rms_norm as fused_rms_norm
        from lorafleet.kernels.layers.rope_kv import rope_write_kv

        c, w = self.config, self.weights
        eps = c.rms_norm_eps
        x = fused_rms_norm(h, w["layers.0.in_norm_fused"], eps)
        rows = None if lora_meta is None else lora_meta.has_lora
        for i in range(c.num_layers):
            p = f"layers.{i}."
            qkv, d = self._qkv_for_rope(x, i, lora_meta, graph)
            k_cache, v_cache = kv_caches[i]
            cos_sin = self.rotaries[self._rotary_index(i)].cos_sin
            q = rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, attn.slot_mapping, d, rows)
            o = paged_attention(q, k_cache, v_cache, attn, c.attention_scale, self.attention_backend,
                                window=c.window(i), softcap=c.attn_logit_softcapping).reshape(-1, c.q_size)
            o = fused_rms_norm(self._linear(o, i, "o_proj", lora_meta, graph), w[p + "post_norm_fused"], eps)
            x = add_rms_norm(o, h, w[p + "pre_ff_norm_fused"], eps)
            gate, up = self._linear(x, i, "gate_up_proj", lora_meta, graph).chunk(2, dim=-1)
            down = self._linear(activation(c.hidden_act, gate) * up, i, "down_proj", lora_meta, graph)
            down = fused_rms_norm(down, w[p + "post_ff_norm_fused"], eps)
            next_norm = w[f"layers.{i + 1}.in_norm_fused"] if i + 1 < c.num_layers else w["norm_fused"]
            x = add_rms_norm(down, h, next_norm, eps)
        return x.index_select(0, logits_indices)

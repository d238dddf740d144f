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
    FUSED_ELEMENTWISE = False  # the fused kernels compute Llama's norms and SiLU

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rotaries: list[Rotary] = [self.rotary]  # Gemma 3 adds its local layers' tables

    def _rotary_index(self, layer: int) -> int:
        return 0

    def load_weights(self, named) -> None:
        super().load_weights(named)
        self.weights["norm"] = 1.0 + self.weights["norm"].float()

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "pre_ff_norm"] = _take(pending, p + "pre_feedforward_layernorm.weight")
        w[p + "post_ff_norm"] = _take(pending, p + "post_feedforward_layernorm.weight")
        for n in NORMS:  # offsets -> the factors they stand for, kept in fp32
            w[p + n] = 1.0 + w[p + n].float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora_meta: LoraMeta | None,
        logits_indices: torch.Tensor,
        graph: bool = False,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """As `LlamaModel.forward`: logits `[N, vocab]`, soft-capped when the config says so."""
        embed = self.weights["embed"]
        h = F.embedding(input_ids, embed) * torch.tensor(self.config.hidden_size**0.5, dtype=embed.dtype)
        h = self._layers_torch(h, positions, attn, kv_caches, lora_meta, logits_indices, graph)
        logits = F.linear(h, self.weights["lm_head"])
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float_logits else logits

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

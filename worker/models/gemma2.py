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

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from lorafleet.kernels.layers.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from lorafleet.kernels.layers.rope_kv import rope_write_kv
from lorafleet.kernels.layers.silu_mul import silu_mul, silu_mul_reference
from lorafleet.kernels.layers.soft_cap import soft_cap_, soft_cap_reference
from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.worker.layers.attention import AttentionMetadata, paged_attention, write_kv
from lorafleet.worker.models.llama import LlamaModel, Rotary, _take

# The row ops of the layer, per backend: the torch references (the CPU path, and the oracle) or the
# Triton kernels Llama's fused path uses, with Gemma's flags (`offset`: the `1 + w` weights; an
# `x_weight` norm before the residual add; the GELU-tanh activation).
TORCH_OPS = SimpleNamespace(rms_norm=rms_norm_reference, add_rms_norm=add_rms_norm_reference,
                            act_mul=silu_mul_reference)
TRITON_OPS = SimpleNamespace(rms_norm=rms_norm, add_rms_norm=add_rms_norm, act_mul=silu_mul)


def gemma_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: (x̂ · (1 + w)) in fp32, then x's dtype; `w` is the checkpoint's offset."""
    return rms_norm_reference(x, w, eps, offset=True)


def soft_cap(logits: torch.Tensor, cap: float | None, fused: bool = False) -> torch.Tensor:
    """cap · tanh(logits / cap), in the logits' dtype as transformers computes it (None: unchanged);
    fused: in place, one Triton launch (`kernels/layers/soft_cap.py`) where torch takes three."""
    if cap is None:
        return logits
    return soft_cap_(logits, cap) if fused else soft_cap_reference(logits, cap)


class Gemma2Model(LlamaModel):
    """One layer for both backends (`_layers`): the norms, residual adds and gated activation run
    as the torch references or as Llama's Triton row kernels with Gemma's flags, the same 4
    elementwise launches a layer as Llama's (RoPE/KV write, post-attention norm + residual add +
    pre-feedforward norm, GELU-tanh · up, post-feedforward norm + residual add + the next input
    norm); the final logits' soft-capping is one kernel too. The norm weights stay the
    checkpoint's offsets, in the model's dtype."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rotaries: list[Rotary] = [self.rotary]  # Gemma 3 adds its local layers' tables
        # sqrt(hidden) rounded to the weights' dtype first, as transformers scales the embedding.
        self.embed_scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype))

    def _rotary_index(self, layer: int) -> int:
        return 0

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "pre_ff_norm"] = _take(pending, p + "pre_feedforward_layernorm.weight")
        w[p + "post_ff_norm"] = _take(pending, p + "post_feedforward_layernorm.weight")

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights["embed"]) * self.embed_scale

    def _fused_rows(self) -> bool:
        """Whether the row ops run as Triton kernels (the backend `forward` runs `_layers_fused` on)."""
        return self.attention_backend == "triton" and self.FUSED_ELEMENTWISE

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits, soft-capped when the config says so."""
        return soft_cap(F.linear(h, self.weights["lm_head"]), self.config.final_logit_softcapping, self._fused_rows())

    def _layers_torch(self, h, positions, attn, kv_caches, lora_meta, logits_indices, graph) -> torch.Tensor:
        return self._layers(h, positions, attn, kv_caches, lora_meta, logits_indices, graph, fused=False)

    def _layers_fused(self, h, positions, attn, kv_caches, lora_meta, logits_indices, graph) -> torch.Tensor:
        return self._layers(h, positions, attn, kv_caches, lora_meta, logits_indices, graph, fused=True)

    def _layers(
        self,
        h: torch.Tensor,  # [T, hidden], the residual stream: updated in place
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora_meta: LoraMeta | None,
        logits_indices: torch.Tensor,
        graph: bool,
        fused: bool,
    ) -> torch.Tensor:
        """The decoder layers and the final norm -> `[N, hidden]` at logits_indices. Per layer: qkv
        linear -> RoPE, K/V write -> attention (windowed, soft-capped) -> o linear -> add_rms_norm
        (post-attention norm of o, residual add, pre-feedforward norm) -> gate_up linear -> GELU-tanh
        · up -> down linear -> add_rms_norm (post-feedforward norm, residual add, the next layer's
        input norm or the final norm, over all T rows before the logits rows are picked). A LoRA
        delta left beside a GEMM is added by the row op after it."""
        ops = TRITON_OPS if fused else TORCH_OPS
        c, w = self.config, self.weights
        eps = c.rms_norm_eps
        x = ops.rms_norm(h, w["layers.0.in_norm"], eps, offset=True)
        rows = None if lora_meta is None else lora_meta.has_lora  # where a LoRA delta is defined
        tables = None if fused else [r.at(positions, h.dtype) for r in self.rotaries]  # (cos, sin) per RoPE base
        for i in range(c.num_layers):
            p = f"layers.{i}."
            k_cache, v_cache = kv_caches[i]
            if fused:
                qkv, d = self._qkv_for_rope(x, i, lora_meta, graph)
                cos_sin = self.rotaries[self._rotary_index(i)].cos_sin
                q = rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, attn.slot_mapping, d, rows)
            else:
                q, k, v = self._linear(x, i, "qkv_proj", lora_meta, graph).split([c.q_size, c.kv_size, c.kv_size], -1)
                q, k = self._rope_qk(q, k, i, *tables[self._rotary_index(i)])
                write_kv(k_cache, v_cache, k, v.reshape(-1, c.num_kv_heads, c.head_dim), attn.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, attn, c.attention_scale, self.attention_backend,
                                window=c.window(i), softcap=c.attn_logit_softcapping).reshape(-1, c.q_size)
            o, d = self._linear_deferred(o, i, "o_proj", lora_meta, graph)
            x = ops.add_rms_norm(o, h, w[p + "pre_ff_norm"], eps, d, rows, x_weight=w[p + "post_norm"], offset=True)
            gate_up, d = self._linear_deferred(x, i, "gate_up_proj", lora_meta, graph)
            act = ops.act_mul(gate_up, d, rows, activation=c.hidden_act)  # [T, intermediate]
            down, d = self._linear_deferred(act, i, "down_proj", lora_meta, graph)
            next_norm = w[f"layers.{i + 1}.in_norm"] if i + 1 < c.num_layers else w["norm"]
            x = ops.add_rms_norm(down, h, next_norm, eps, d, rows, x_weight=w[p + "post_ff_norm"], offset=True)
        return x.index_select(0, logits_indices)

"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k before RoPE.

Checkpoint names: Llama's, plus `self_attn.q_norm.weight` and `self_attn.k_norm.weight` per layer
(`[head_dim]` each, Llama-style `w · x̂`). Adapters target q/k/v/o/gate/up/down_proj as on Llama.
No attention bias (`attention_bias: false`); sliding windows only with `use_sliding_window`.
"""

from __future__ import annotations

import torch

from lorafleet.worker.models.head_norm import HeadNormAttention
from lorafleet.worker.models.llama import LlamaModel, _take


class Qwen3Model(HeadNormAttention, LlamaModel):
    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "q_norm"] = _take(pending, p + "self_attn.q_norm.weight")
        w[p + "k_norm"] = _take(pending, p + "self_attn.k_norm.weight")

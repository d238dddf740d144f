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

from lorafleet.worker.models.gemma2 import Gemma2Model, gemma_rms_norm
from lorafleet.worker.models.head_norm import HeadNormAttention
from lorafleet.worker.models.llama import Rotary, _take


class Gemma3Model(HeadNormAttention, Gemma2Model):
    NORM_OFFSET = True
    head_norm = staticmethod(gemma_rms_norm)

    def __init__(self, config, device, dtype, max_positions: int) -> None:
        super().__init__(config, device, dtype, max_positions)
        self.rotaries.append(Rotary(config, max_positions, device, local=True))

    def _rotary_index(self, layer: int) -> int:
        types = self.config.layer_types
        return 1 if types and types[layer] == "sliding_attention" else 0

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        super()._take_layer(pending, w, p)
        w[p + "q_norm"] = _take(pending, p + "self_attn.q_norm.weight")  # Gemma's offsets from 1
        w[p + "k_norm"] = _take(pending, p + "self_attn.k_norm.weight")

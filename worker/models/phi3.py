"""Phi-3: the Llama decoder with q/k/v and gate/up fused in the checkpoint itself.

Checkpoint names: `self_attn.qkv_proj.weight` (`[q_size + 2 kv_size, hidden]`, q then k then v),
`self_attn.o_proj.weight`, `mlp.gate_up_proj.weight` (`[2 intermediate, hidden]`, gate then up),
`mlp.down_proj.weight`, `input_layernorm`, `post_attention_layernorm`. Adapters are trained on those
modules (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`): a fused module's A is shared by its
slices and its B is cut into them at load (`ModelConfig.adapter_targets`), so they batch with the
same slots and kernels as every other family. RoPE may be `longrope` (`su`): `Rotary` takes its
short/long factors and attention factor; every layer attends through `sliding_window` when set.
"""

from __future__ import annotations

import torch

from lorafleet.worker.models.llama import LlamaModel, _take


class Phi3Model(LlamaModel):
    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        w[p + "qkv"] = _take(pending, p + "self_attn.qkv_proj.weight")
        w[p + "o"] = _take(pending, p + "self_attn.o_proj.weight")
        w[p + "gate_up"] = _take(pending, p + "mlp.gate_up_proj.weight")
        w[p + "down"] = _take(pending, p + "mlp.down_proj.weight")
        w[p + "in_norm"] = _take(pending, p + "input_layernorm.weight")
        w[p + "post_norm"] = _take(pending, p + "post_attention_layernorm.weight")

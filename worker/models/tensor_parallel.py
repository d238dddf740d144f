"""A model family's class, sharded: the same layers on a rank's shard config, plus the three places
a tensor-parallel forward communicates (docs/tensor_parallel.md).

- row-parallel projections (o_proj, down_proj): the partial output, LoRA delta included (its shrink
  on this rank's input columns, expanded with the full B), is summed over the ranks in one all-reduce;
- the vocab-parallel embedding: ids outside this rank's rows look up zeros, then one all-reduce;
- the vocab-parallel lm_head: each rank's logit columns gathered to rank 0 (the others get no rows
  back from `forward`: only rank 0 samples).

Only a model built by `sharded_class` runs any of this: the single-device classes are untouched.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.models.sharding import ROW_TARGETS, Shard, shard_config


class TensorParallel:
    """Mixin in front of a LlamaModel family class; `shard` and `full_vocab` are set by `sharded_class`'s caller."""

    shard: Shard
    full_vocab: int
    on_step = None  # rank 0: called with a forward's inputs before it runs (the step broadcast)

    def _linear_deferred(self, x: torch.Tensor, layer: int, fused: str, meta: LoraMeta | None, graph: bool = False,
                         beside: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fused not in ROW_TARGETS:
            return super()._linear_deferred(x, layer, fused, meta, graph, beside)  # type: ignore[misc]
        # The delta is added before the sum, never deferred: the all-reduce carries base and LoRA together.
        y, _ = super()._linear_deferred(x, layer, fused, meta, graph, beside=False)  # type: ignore[misc]
        dist.all_reduce(y)
        return y, None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.weights["embed"]  # type: ignore[attr-defined]  # [V', hidden]
        lo = self.shard.rank * w.shape[0]
        local = input_ids - lo
        inside = (local >= 0) & (local < w.shape[0])
        h = F.embedding(local.clamp(0, w.shape[0] - 1), w) * inside.unsqueeze(1).to(w.dtype)
        dist.all_reduce(h)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Rank 0: the full logits `[N, vocab]`; the other ranks send their columns and get `[0, V']` back."""
        part = F.linear(h, self.weights["lm_head"]).contiguous()  # type: ignore[attr-defined]  # [N, V']
        if self.shard.rank != 0:
            dist.gather(part, None, dst=0)
            return part[:0]
        parts = [torch.empty_like(part) for _ in range(self.shard.world)]
        dist.gather(part, parts, dst=0)
        return torch.cat(parts, dim=1)[:, : self.full_vocab]

    def forward(self, input_ids, positions, attn, kv_caches, lora_meta, logits_indices, graph=False,
                float_logits=True) -> torch.Tensor:
        """LlamaModel.forward on this rank's shard (rank 0 gets the logits). On rank 0, `on_step`
        (the engine's broadcast of the step to the other ranks) runs first."""
        if self.on_step is not None:
            self.on_step(input_ids, positions, attn, lora_meta, logits_indices)
        return super().forward(input_ids, positions, attn, kv_caches, lora_meta, logits_indices,  # type: ignore[misc]
                               graph, float_logits)


@cache
def sharded_class(cls: type[LlamaModel]) -> type[LlamaModel]:
    """`cls` with the tensor-parallel communication in front of its layers."""
    return type(f"TensorParallel{cls.__name__}", (TensorParallel, cls), {})


def build_sharded(cls: type[LlamaModel], full_config, shard: Shard, device: torch.device, dtype: torch.dtype,
                  max_positions: int) -> LlamaModel:
    """A rank's model, on the shard config, weights not loaded yet (`sharding.shard_checkpoint` them)."""
    model = sharded_class(cls)(shard_config(full_config, shard.world), device, dtype, max_positions)
    model.shard = shard  # type: ignore[attr-defined]
    model.full_vocab = full_config.vocab_size  # type: ignore[attr-defined]
    return model

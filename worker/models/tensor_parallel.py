"""A model family's class, sharded: the same layers on a rank's shard config, plus the three places
a tensor-parallel forward communicates (docs/tensor_parallel.md).

- row-parallel projections (o_proj, down_proj): the partial output, LoRA delta included (its shrink
  on this rank's input columns, expanded with the full B), is summed over the ranks in one all-reduce;
- the vocab-parallel embedding: ids outside this rank's rows look up zeros, then one all-reduce;
- the vocab-parallel lm_head: each rank's logit columns gathered to rank 0 (the others get no rows
  back from `forward`: only rank 0 samples), soft-capped there when the family caps its logits;
- `--quantization fp8`: the row-parallel rows' largest magnitudes all-reduced (max) once, at load,
  so a row's scale is the whole row's (`quantize_sharded`);
- DoRA: once per adapter read, the row-parallel modules' squared column norms all-reduced and every
  rank's scales gathered to rank 0 (`sharded_dora_scales`); per step, a row-parallel projection's
  DoRA epilogue runs after its all-reduce, on the whole sum.

Only a model built by `sharded_class` runs any of this: the single-device classes are untouched.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.quant.fp8_linear import quantize_rows
from lorafleet.worker.config import FUSED_SLICES, ModelConfig
from lorafleet.worker.layers.quant import LINEAR_KEYS
from lorafleet.worker.lora.dora import row_norms_sq, scales_from_norms
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.weights import LoraWeights
from lorafleet.worker.models.gemma2 import soft_cap
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.models.sharding import ROW_TARGETS, Shard, shard_config, shard_lora


class Collectives:
    """A rank's communication: torch.distributed's default group (NCCL on CUDA, gloo on CPU). A
    benchmark of one rank's shard on one device puts a stand-in with the same methods in its place."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """`t` summed (or maxed) over the ranks, in place."""
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    def gather(self, t: torch.Tensor, shard: Shard) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) on rank 0, in rank order; None on the others."""
        if shard.rank != 0:
            dist.gather(t, None, dst=0)
            return None
        parts = [torch.empty_like(t) for _ in range(shard.world)]
        dist.gather(t, parts, dst=0)
        return parts


class TensorParallel:
    """Mixin in front of a LlamaModel family class; `shard`, `full_vocab` and `comm` are set by `build_sharded`."""

    shard: Shard
    full_vocab: int
    comm: Collectives
    on_step = None  # rank 0: called with a forward's inputs before it runs (the step broadcast)

    def _linear_deferred(self, x: torch.Tensor, layer: int, fused: str, meta: LoraMeta | None, graph: bool = False,
                         beside: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fused not in ROW_TARGETS:
            return super()._linear_deferred(x, layer, fused, meta, graph, beside)  # type: ignore[misc]
        # The delta is added before the sum, never deferred: the all-reduce carries base and LoRA together.
        # DoRA's rescaling b + g ⊙ (y - b) is of the whole sum: `_dora` skips it on the partial one.
        y, _ = super()._linear_deferred(x, layer, fused, meta, graph, beside=False)  # type: ignore[misc]
        self.comm.all_reduce(y)
        lora = self.lora  # type: ignore[attr-defined]
        if meta is not None and (graph or not meta.empty) and lora is not None and fused in lora.layers[layer]:
            super()._dora(layer, fused, y, None, meta, None, graph)  # type: ignore[misc]
        return y, None

    def _dora(self, layer: int, fused: str, y: torch.Tensor, delta: torch.Tensor | None, meta: LoraMeta,
              bias: torch.Tensor | None, graph: bool) -> None:
        """Skipped on a row-parallel projection's partial sum: `_linear_deferred` runs it on the whole one."""
        if fused not in ROW_TARGETS:
            super()._dora(layer, fused, y, delta, meta, bias, graph)  # type: ignore[misc]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows summed over the ranks (exactly: every other rank adds zeros), then the family's
        scale (Gemma's sqrt(hidden), in the weights' dtype) as its own `_embed` applies it."""
        w = self.weights["embed"]  # type: ignore[attr-defined]  # [V', hidden]
        lo = self.shard.rank * w.shape[0]
        local = input_ids - lo
        inside = (local >= 0) & (local < w.shape[0])
        h = F.embedding(local.clamp(0, w.shape[0] - 1), w) * inside.unsqueeze(1).to(w.dtype)
        self.comm.all_reduce(h)
        scale = getattr(self, "embed_scale", None)
        return h if scale is None else h * scale

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Rank 0: the full logits `[N, vocab]`; the other ranks send their columns and get `[0, V']` back."""
        part = F.linear(h, self.weights["lm_head"]).contiguous()  # type: ignore[attr-defined]  # [N, V']
        parts = self.comm.gather(part, self.shard)
        if parts is None:
            return part[:0]
        logits = torch.cat(parts, dim=1)[:, : self.full_vocab]
        cap = self.config.final_logit_softcapping  # type: ignore[attr-defined]  # Gemma 2
        return soft_cap(logits, cap, cap is not None and self._fused_rows())  # type: ignore[attr-defined]

    def forward(self, input_ids, positions, attn, kv_caches, lora_meta, logits_indices, graph=False,
                float_logits=True) -> torch.Tensor:
        """LlamaModel.forward on this rank's shard (rank 0 gets the logits). On rank 0, `on_step`
        (the engine's broadcast of the step to the other ranks) runs first, except in a decode graph
        (`graph`): its capture and each replay are broadcast by the graphs (parallel.RankGraphs), and
        nothing may reach the host inside a capture."""
        if self.on_step is not None and not graph:
            self.on_step(input_ids, positions, attn, lora_meta, logits_indices)
        return super().forward(input_ids, positions, attn, kv_caches, lora_meta, logits_indices,  # type: ignore[misc]
                               graph, float_logits)


def sharded_dora_scales(model: LlamaModel, full: ModelConfig, weights: LoraWeights) -> dict[str, torch.Tensor] | None:
    """DoRA's g = m / ||W + s·B·A|| for this rank's rows of each fused projection; every rank's are
    gathered to rank 0: `{fused: [world, num_layers, out/N]}` float32 on the host there, None on the
    others. All ranks call it together. Column-parallel modules: the rank's rows of W with its rows
    of B and the whole A (local). Row-parallel ones: the squared norms over the rank's input columns,
    summed over the ranks (one all-reduce for all of them). AdapterError on rank 0 if a scale is
    not finite (the other ranks never refuse: rank 0 decides)."""
    shard: Shard = model.shard  # type: ignore[attr-defined]
    local = shard_lora(weights, full, shard)
    sq = row_norms_sq(local, model.base_weight)
    row = [key for key in sorted(sq) if key[1] in ROW_TARGETS]
    if row:
        summed = torch.cat([sq[key] for key in row])
        model.comm.all_reduce(summed)  # type: ignore[attr-defined]
        sq.update(zip(row, summed.split([sq[key].numel() for key in row])))
    g = scales_from_norms(local, model.config, {key: v.sqrt() for key, v in sq.items()}, check=False)
    flat = torch.cat([g[f].reshape(-1) for f in FUSED_SLICES]).to(model.device)
    parts = model.comm.gather(flat, shard)  # type: ignore[attr-defined]
    if parts is None:
        return None
    stacked = torch.stack(parts).cpu()  # [world, Σ fused L·out]
    out, start = {}, 0
    for f in FUSED_SLICES:
        n = g[f].numel()
        out[f] = stacked[:, start : start + n].reshape(shard.world, *g[f].shape)
        start += n
        bad = (~torch.isfinite(out[f])).any(dim=0).any(dim=1).nonzero()
        if bad.numel():
            raise AdapterError("bad_weights", f"layer {int(bad[0])} {f}: DoRA's scale is not finite "
                               "(a zero weight norm, or a magnitude that overflows)")
    return out


def quantize_sharded(model: LlamaModel) -> None:
    """`--quantization fp8` on a rank's shard, per output row as on one device: a column-parallel
    rank holds whole rows; a row-parallel one only some columns of each, so each row's largest
    magnitude is the max over the ranks (one all-reduce for every layer's o and down), and every
    rank's part of a row shares the whole row's scale."""
    w, layers = model.weights, range(model.config.num_layers)
    row_keys = [f"layers.{i}.{key}" for i in layers for key in ("o", "down")]
    amax = torch.cat([w[k].float().abs().amax(dim=1) for k in row_keys])
    model.comm.all_reduce(amax, op="max")  # type: ignore[attr-defined]
    whole = dict(zip(row_keys, amax.split([w[k].shape[0] for k in row_keys])))
    for i in layers:
        for key in LINEAR_KEYS:
            k = f"layers.{i}.{key}"
            w[k], w[k + "_scale"] = quantize_rows(w[k], whole.get(k))


@cache
def sharded_class(cls: type[LlamaModel]) -> type[LlamaModel]:
    """`cls` with the tensor-parallel communication in front of its layers."""
    return type(f"TensorParallel{cls.__name__}", (TensorParallel, cls), {})


def build_sharded(cls: type[LlamaModel], full_config, shard: Shard, device: torch.device, dtype: torch.dtype,
                  max_positions: int) -> LlamaModel:
    """A rank's model, on the shard config, weights not loaded yet (`sharding.shard_checkpoint` them)."""
    model = sharded_class(cls)(shard_config(full_config, shard.world), device, dtype, max_positions)
    model.shard = shard  # type: ignore[attr-defined]
    model.comm = Collectives()  # type: ignore[attr-defined]
    model.full_vocab = full_config.vocab_size  # type: ignore[attr-defined]
    return model

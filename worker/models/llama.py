"""Llama-family decoder (Llama, Mistral, Qwen2) with fused projections and a multi-LoRA side path.

The other families (worker/models/qwen3.py, gemma2.py, gemma3.py, phi3.py) subclass it and change
what differs: the weights they load (`_take_layer`), q and k before attention (`_rope_qk`), or the
whole layer (Gemma). Sliding-window layers (`ModelConfig.window`) pass their window to the attention.

q/k/v and gate/up are fused into one base matmul each; every fused projection then adds each
token's LoRA deltas through `lorafleet.kernels.lora.linear.linear_lora_deferred` (torch reference on CPU, Triton
on CUDA), reading the step's LoRA metadata that was built once for all layers.

Between the matmuls, `attention_backend` picks the elementwise path too: "torch" (the CPU path,
and the oracle) or "triton", which fuses each layer's norms, residual adds, RoPE, K/V writes and
SiLU into 4 launches (`lorafleet.kernels.layers.rms_norm`, `.rope_kv`, `.silu_mul`), where a decode step is
launch-bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from lorafleet.kernels.lora.linear import linear_lora_deferred
from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.quant.fp8_linear import dequantize
from lorafleet.worker.config import LORA_TARGETS, ModelConfig, rope_inv_freq
from lorafleet.worker.layers.attention import AttentionMetadata, paged_attention, write_kv
from lorafleet.worker.layers.quant import linear
from lorafleet.worker.lora.slots import LoraSlots


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm, so fp32 logits match to rounding.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """cos/sin tables for every position, computed once (HF's non-interleaved rotate-half layout).

    local: Gemma 3's sliding-window layers' base. longrope (Phi-3): the short factors below
    `original_max_position_embeddings`, the long ones from there on, cos and sin scaled by its
    attention factor (transformers picks one set for a whole forward from its length: the same
    as here for every position a prompt shorter than the original length reaches)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, local: bool = False) -> None:
        def inv(long: bool) -> torch.Tensor:
            return torch.tensor(rope_inv_freq(config, local, long), dtype=torch.float32, device=device)

        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        s = config.rope_local_scaling if local and config.rope_local_theta is not None else config.rope_scaling
        freqs = torch.outer(t, inv(False))  # [P, head_dim / 2]
        factor = 1.0
        if s.rope_type == "longrope":
            long = (t >= s.original_max_position_embeddings).unsqueeze(1)
            freqs = torch.where(long, torch.outer(t, inv(True)), freqs)
            factor = s.attention_factor
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, head_dim]
        self.cos, self.sin = emb.cos() * factor, emb.sin() * factor
        # [P, head_dim]: cos | sin of each rotary pair, the layout `rope_kv.rope_write_kv` reads.
        self.cos_sin = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, `[T, 1, head_dim]` each (gathered once per step)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: `[T, heads, head_dim]`."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class LlamaModel:
    """Weights as plain tensors (no nn.Module: nothing here trains); `forward` runs one step."""

    # Whether the Triton elementwise kernels (`_layers_fused`) compute this family's layer: a family
    # with other maths between the matmuls runs `_layers_torch` on every backend (its attention
    # still takes the backend's kernel).
    FUSED_ELEMENTWISE = True

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.weights: dict[str, torch.Tensor] = {}
        self.rotary = Rotary(config, max_positions, device)
        self.lora: LoraSlots | None = None
        self.lora_backend = "torch"
        # Triton LoRA on CUDA: the side paths run here, beside the base GEMMs (`linear_lora_deferred`).
        self.lora_stream: torch.cuda.Stream | None = None
        self.attention_backend = "torch"  # also picks the elementwise ops: torch | triton (fused kernels)

    # -- loading -------------------------------------------------------------------------------
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take checkpoint tensors by their Hugging Face names; fuse q/k/v and gate/up on the way."""
        pending: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            key = _short_name(name)
            if key is None:
                continue
            # FP8 weights keep their e4m3 values (lorafleet.worker.layers.quant adds their scales).
            pending[key] = tensor.to(self.device) if tensor.dtype == torch.float8_e4m3fn else tensor.to(self.device, self.dtype)
        c = self.config
        w: dict[str, torch.Tensor] = {}
        w["embed"] = _take(pending, "embed_tokens.weight")
        w["norm"] = _take(pending, "norm.weight")
        w["lm_head"] = w["embed"] if c.tie_word_embeddings else pending.pop("lm_head.weight", None)
        if w["lm_head"] is None:
            # Some checkpoints tie weights without saying so in config.json.
            w["lm_head"] = w["embed"]
        for i in range(c.num_layers):
            self._take_layer(pending, w, f"layers.{i}.")
        leftovers = [k for k in pending if "rotary_emb" not in k]
        if leftovers:
            raise ValueError(f"checkpoint has tensors this model does not use: {leftovers[:5]}")
        self.weights = w

    def _take_layer(self, pending: dict[str, torch.Tensor], w: dict[str, torch.Tensor], p: str) -> None:
        """Move layer `p`'s tensors from the checkpoint's names (`pending`) into `w`, fusing q/k/v and gate/up."""
        w[p + "qkv"] = torch.cat([_take(pending, p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        if self.config.qkv_bias:
            w[p + "qkv_bias"] = torch.cat([_take(pending, p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        w[p + "o"] = _take(pending, p + "self_attn.o_proj.weight")
        w[p + "gate_up"] = torch.cat([_take(pending, p + "mlp.gate_proj.weight"), _take(pending, p + "mlp.up_proj.weight")])
        w[p + "down"] = _take(pending, p + "mlp.down_proj.weight")
        w[p + "in_norm"] = _take(pending, p + "input_layernorm.weight")
        w[p + "post_norm"] = _take(pending, p + "post_attention_layernorm.weight")

    def _qkv_for_rope(
        self, x: torch.Tensor, layer: int, lora_meta: LoraMeta | None, graph: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused path's qkv projection -> (qkv, LoRA delta or None), as `rope_write_kv` takes them."""
        return self._linear_deferred(x, layer, "qkv_proj", lora_meta, graph)

    def _rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, q_size]`, k `[T, kv_size]` -> rotated `[T, heads, head_dim]`, `[T, kv_heads, head_dim]`."""
        c = self.config
        return (Rotary.apply(q.reshape(-1, c.num_heads, c.head_dim), cos, sin),
                Rotary.apply(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin))

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.weights.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    # -- forward -------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, layer: int, fused: str, meta: LoraMeta | None, graph: bool = False) -> torch.Tensor:
        """The fused projection with its LoRA added in place (the torch path: no row kernel takes a delta)."""
        return self._linear_deferred(x, layer, fused, meta, graph, beside=False)[0]

    def _linear_deferred(
        self, x: torch.Tensor, layer: int, fused: str, meta: LoraMeta | None, graph: bool = False, beside: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused projection -> (y, LoRA delta or None): the delta, when the side path ran on
        `lora_stream` beside the GEMM (`beside`), is for the next fused row kernel to add
        (`linear_lora_deferred`)."""
        w = self.weights
        key = f"layers.{layer}.{fused.removesuffix('_proj')}"

        def base() -> torch.Tensor:
            return linear(x, w[key], w.get(key + "_bias"), w.get(key + "_scale"))

        # In a graph, whether a token has an adapter is data: launch even for an empty meta.
        if meta is not None and (graph or not meta.empty) and self.lora is not None:
            s = self.lora.layers[layer].get(fused)
            if s is not None:
                y, d = linear_lora_deferred(base, x, s.lora_a, s.lora_b, s.ranks, s.ranks_device, meta,
                                            self.lora_backend, self.lora_stream if beside else None)
                self._dora(layer, fused, y, d, meta, w.get(key + "_bias"), graph)
                return y, d
        return base(), None

    def _dora(self, layer: int, fused: str, y: torch.Tensor, delta: torch.Tensor | None, meta: LoraMeta,
              bias: torch.Tensor | None, graph: bool) -> None:
        """DoRA's epilogue on a projection's output (`LoraSlots.apply_dora`); tensor parallelism moves
        a row-parallel one's after its all-reduce."""
        assert self.lora is not None
        self.lora.apply_dora(layer, fused, y, delta, meta, bias, self.lora_backend, graph)

    def base_weight(self, layer: int, target: str) -> torch.Tensor:
        """A LoRA target's base weight `[out, in]`: its rows of the fused projection (DoRA's norms)."""
        fused, index = LORA_TARGETS[target]
        start = sum(out for _, out in self.config.slice_sizes(fused)[:index])
        rows = self.config.slice_sizes(fused)[index][1]
        key = f"layers.{layer}.{fused.removesuffix('_proj')}"
        weight = self.weights[key][start : start + rows]
        scale = self.weights.get(key + "_scale")  # FP8 weights: the values the GEMM multiplies by
        return weight if scale is None else dequantize(weight, scale[start : start + rows], self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora_meta: LoraMeta | None,
        logits_indices: torch.Tensor,  # [N] rows of the step whose logits are wanted
        graph: bool = False,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """One engine step over all scheduled tokens -> logits `[N, vocab]` (float32 by default).

        graph: the step runs in (or is captured into) a CUDA graph (`worker/engine/cuda_graphs.py`): no
        host checks may skip a launch, and `attn` must have fixed shapes. float_logits=False leaves
        the logits in the model's dtype, as the lm_head computed them (`.float()` of them is what
        float_logits=True returns, bit for bit).
        """
        h = self._embed(input_ids)  # [T, hidden]
        if self.attention_backend == "triton" and self.FUSED_ELEMENTWISE:
            h = self._layers_fused(h, positions, attn, kv_caches, lora_meta, logits_indices, graph)
        else:
            h = self._layers_torch(h, positions, attn, kv_caches, lora_meta, logits_indices, graph)
        logits = self._logits(h)
        return logits.float() if float_logits else logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weights["embed"])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weights["lm_head"])

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
        """The decoder layers and the final norm in plain torch ops -> `[N, hidden]` at logits_indices."""
        c, w = self.config, self.weights
        scale = c.attention_scale
        cos, sin = self.rotary.at(positions, h.dtype)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "in_norm"], c.rms_norm_eps)
            qkv = self._linear(x, i, "qkv_proj", lora_meta, graph)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q, k = self._rope_qk(q, k, i, cos, sin)
            v = v.reshape(-1, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, attn, scale, self.attention_backend,
                                window=c.window(i)).reshape(-1, c.q_size)
            h = h + self._linear(o, i, "o_proj", lora_meta, graph)
            x = rms_norm(h, w[p + "post_norm"], c.rms_norm_eps)
            gate, up = self._linear(x, i, "gate_up_proj", lora_meta, graph).chunk(2, dim=-1)
            h = h + self._linear(F.silu(gate) * up, i, "down_proj", lora_meta, graph)
        return rms_norm(h.index_select(0, logits_indices), w["norm"], c.rms_norm_eps)

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
        """The same with the Triton elementwise kernels: each residual add fused into the next norm.

        Per layer: qkv linear -> rope_write_kv -> attention -> o linear -> add_rms_norm -> gate_up
        linear -> silu_mul -> down linear -> add_rms_norm (the next layer's input norm, or the
        final norm, taken over all T rows before the logits rows are picked).
        """
        from lorafleet.kernels.layers.rms_norm import add_rms_norm
        from lorafleet.kernels.layers.rms_norm import rms_norm as fused_rms_norm
        from lorafleet.kernels.layers.rope_kv import rope_write_kv
        from lorafleet.kernels.layers.silu_mul import silu_mul

        c, w = self.config, self.weights
        eps, scale = c.rms_norm_eps, c.attention_scale
        x = fused_rms_norm(h, w["layers.0.in_norm"], eps)
        rows = None if lora_meta is None else lora_meta.has_lora  # where a LoRA delta is defined
        for i in range(c.num_layers):
            p = f"layers.{i}."
            qkv, d = self._qkv_for_rope(x, i, lora_meta, graph)  # [T, q_size + 2 kv_size]
            k_cache, v_cache = kv_caches[i]
            q = rope_write_kv(qkv, positions, self.rotary.cos_sin, k_cache, v_cache, attn.slot_mapping, d, rows)
            o = paged_attention(q, k_cache, v_cache, attn, scale, self.attention_backend,
                                window=c.window(i)).reshape(-1, c.q_size)
            o, d = self._linear_deferred(o, i, "o_proj", lora_meta, graph)
            x = add_rms_norm(o, h, w[p + "post_norm"], eps, d, rows)
            gate_up, d = self._linear_deferred(x, i, "gate_up_proj", lora_meta, graph)
            act = silu_mul(gate_up, d, rows)  # [T, intermediate]
            next_norm = w[f"layers.{i + 1}.in_norm"] if i + 1 < c.num_layers else w["norm"]
            down, d = self._linear_deferred(act, i, "down_proj", lora_meta, graph)
            x = add_rms_norm(down, h, next_norm, eps, d, rows)
        return x.index_select(0, logits_indices)


def _short_name(name: str) -> str | None:
    for prefix in ("model.", ""):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest.startswith(("embed_tokens.", "layers.", "norm.")):
                return rest
    if name.startswith("lm_head."):
        return name
    return None


def _take(pending: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return pending.pop(key)
    except KeyError:
        raise ValueError(f"checkpoint lacks {key!r}") from None


def iter_checkpoint(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from `model.safetensors` or a sharded `model.safetensors.index.json`."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root = Path(folder)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights (pickled .bin checkpoints are not loaded; "
                         "--load-format dummy serves random weights of the config's shapes, for benchmarks)")
    for fname in files:
        with safe_open(str(root / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

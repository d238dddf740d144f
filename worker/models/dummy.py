"""vLLM's `--load-format dummy`: random weights in place of the checkpoint's, for benchmarks.

The model folder needs its config.json and tokenizer only. The tensors are the checkpoint's by name
and shape, as the model's own loader asks for them (a layer's names are recorded from the family's
`_take_layer`), so every family loads them through the same path as a real checkpoint: fused
projections, FP8 quantization at load (`--quantization fp8`), tensor-parallel shards cut from the
whole tensors. Matrices are N(0, 0.02) drawn from one generator seeded with `SEED` on the model's
device, in the checkpoint's order (norm weights 1, biases 0), so every rank of a tensor-parallel
group draws the same whole tensors, and a Llama-shaped model's values equal
bench/engine_build.py's `random_weights` in bfloat16 on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lorafleet.worker.config import ModelConfig
from lorafleet.worker.models.llama import iter_checkpoint

SEED = 0
STD = 0.02


def tensor_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The checkpoint tensor `name`'s shape (a short name: `layers.N.` or top-level, no `model.`)."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.vocab_size, h), "lm_head.weight": (config.vocab_size, h), "norm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.qkv_proj.weight": (q + 2 * kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (config.head_dim,), "self_attn.k_norm.weight": (config.head_dim,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.gate_up_proj.weight": (2 * i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if leaf in shapes:
        return shapes[leaf]
    if leaf.endswith("layernorm.weight"):
        return (h,)
    raise ValueError(f"--load-format dummy: no shape known for the checkpoint tensor {name!r}")


class _Recorder(dict):
    """`pending` for a model's `_take_layer`: the names it takes, in order, each answered with a
    meta tensor of its shape (no memory), so the loader's concatenations run."""

    def __init__(self, shape_of: Callable[[str], tuple[int, ...]]) -> None:
        super().__init__()
        self.shape_of = shape_of
        self.taken: list[str] = []

    def pop(self, key: str, *default: Any) -> torch.Tensor:
        self.taken.append(key)
        return torch.empty(self.shape_of(key), device="meta")


def layer_names(model: Any, config: ModelConfig) -> list[str]:
    """The names one decoder layer of `model`'s family takes from a checkpoint (after `layers.N.`)."""
    recorder = _Recorder(lambda key: tensor_shape(config, key))
    model._take_layer(recorder, {}, "layers.0.")
    return [key.removeprefix("layers.0.") for key in recorder.taken]


def dummy_checkpoint(model: Any, config: ModelConfig, device: torch.device,
                     dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, random tensor) for every tensor `model` (built for `config`, the whole
    model's config even where `model` is one rank's shard) loads, made on `device` in `dtype`."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    per_layer = layer_names(model, config)

    def tensor(name: str) -> torch.Tensor:
        shape = tensor_shape(config, name)
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device, dtype=dtype)
        if name.endswith(".bias"):
            return torch.zeros(shape, device=device, dtype=dtype)
        return torch.randn(shape, device=device, dtype=dtype, generator=gen) * STD

    top = ["embed_tokens.weight", "norm.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    for name in top:
        yield ("" if name.startswith("lm_head") else "model.") + name, tensor(name)
    for layer in range(config.num_layers):
        for leaf in per_layer:
            name = f"layers.{layer}.{leaf}"
            yield "model." + name, tensor(name)


def checkpoint_tensors(model: Any, config: ModelConfig, model_dir: str | Path, load_format: str,
                       device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """What `model` loads under `--load-format`: the folder's safetensors (auto, safetensors) or
    random tensors of their names and shapes (dummy)."""
    if load_format == "dummy":
        return dummy_checkpoint(model, config, device, dtype)
    return iter_checkpoint(str(model_dir))

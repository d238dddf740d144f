"""Megatron tensor-parallel sharding, as data: the shard config, and which slice of each checkpoint
and adapter tensor a rank holds (docs/tensor_parallel.md).

Pure functions over tensors: no communication here (that is `tensor_parallel.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from lorafleet.worker.config import ConfigError, ModelConfig
from lorafleet.worker.lora.weights import LoraWeights, ModuleWeights

# Families whose layers shard as Megatron's: everything between the matmuls is per head (attention,
# q/k norms, soft-capped scores, sliding windows) or per token over the whole hidden state (norms,
# Gemma's scaled embedding and capped logits, applied after the embedding's all-reduce and the
# logits' gather). A new family is refused under TP until it is checked against TP = 1.
TP_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"})
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW_TARGETS = ("o_proj", "down_proj")  # split by input columns; their output is all-reduced
# Modules a checkpoint stores fused (Phi-3), by their parts in row order: cut part by part.
CHECKPOINT_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int
    world: int

    def rows(self, n: int) -> slice:
        """This rank's even share of `n` (n a multiple of world)."""
        step = n // self.world
        return slice(self.rank * step, (self.rank + 1) * step)


def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ConfigError with the reason when `config` cannot be split over `world` ranks."""
    if config.model_type not in TP_FAMILIES:
        raise ConfigError(f"--tensor-parallel-size {world}: the {config.model_type} family is not sharded yet "
                          f"(supported: {', '.join(sorted(TP_FAMILIES))})")
    problems = []
    if config.num_heads % world:
        problems.append(f"{config.num_heads} attention heads")
    if config.intermediate_size % world:
        problems.append(f"intermediate size {config.intermediate_size}")
    kv = config.num_kv_heads
    if kv % world and world % kv:
        problems.append(f"{kv} key/value heads (N and the KV heads must divide one another)")
    if problems:
        raise ConfigError(f"--tensor-parallel-size {world} does not divide the model's {', '.join(problems)}")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config one rank's model is built on: its heads, KV heads and intermediate columns."""
    check_shardable(config, world)
    return dataclasses.replace(config, num_heads=config.num_heads // world,
                               num_kv_heads=max(1, config.num_kv_heads // world),
                               intermediate_size=config.intermediate_size // world)


def vocab_shard(vocab: int, world: int) -> int:
    """Rows of the embedding / lm_head each rank holds (the last shard zero-padded)."""
    return -(-vocab // world)


def kv_head_rows(config: ModelConfig, shard: Shard) -> slice:
    """Rows of k_proj / v_proj rank `shard` holds: its KV heads, or the one it shares when KV < N."""
    kv, d = config.num_kv_heads, config.head_dim
    if kv >= shard.world:
        per = kv // shard.world
        return slice(shard.rank * per * d, (shard.rank + 1) * per * d)
    head = shard.rank * kv // shard.world
    return slice(head * d, (head + 1) * d)


def _vocab_rows(t: torch.Tensor, vocab: int, shard: Shard) -> torch.Tensor:
    n = vocab_shard(vocab, shard.world)
    part = t[shard.rank * n : min((shard.rank + 1) * n, t.shape[0])]
    if part.shape[0] < n:
        part = torch.cat([part, part.new_zeros(n - part.shape[0], *part.shape[1:])])
    return part


def _rows(target: str, n: int, config: ModelConfig, shard: Shard) -> slice:
    """The rows of a column-parallel target (`n` of them in the full tensor) rank `shard` holds."""
    return kv_head_rows(config, shard) if target in ("k_proj", "v_proj") else shard.rows(n)


def _cut_rows(t: torch.Tensor, module: str, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """A column-parallel tensor's rows (weight, bias or per-row scale); a checkpoint-fused module
    (Phi-3's qkv_proj, gate_up_proj) is cut part by part: each rank takes its rows of q, of k and of v."""
    parts = CHECKPOINT_FUSED.get(module)
    if parts is None:
        return t[_rows(module, t.shape[0], config, shard)]
    sizes = [config.q_size, config.kv_size, config.kv_size] if module == "qkv_proj" else [config.intermediate_size] * 2
    if sum(sizes) != t.shape[0]:
        raise ConfigError(f"{module} has {t.shape[0]} rows, not the {sum(sizes)} its parts {parts} add up to")
    return torch.cat([p[_rows(target, size, config, shard)] for target, size, p in zip(parts, sizes, t.split(sizes))])


def _module_and_kind(name: str) -> tuple[str, str | None]:
    """`...q_proj.weight` -> ("q_proj", "weight"); kinds: weight, bias, scale (a weight's FP8 scale), None (any
    other tensor: activation scales, zero points, which are per tensor)."""
    for suffix, kind in ((".weight", "weight"), (".bias", "bias"), (".weight_scale", "scale"),
                         (".weight_scale_inv", "scale")):
        if name.endswith(suffix):
            return name[: -len(suffix)].rsplit(".", 1)[-1], kind
    return "", None


def shard_tensor(name: str, t: torch.Tensor, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """Rank `shard`'s slice of checkpoint tensor `name` (Hugging Face naming), `config` the full one.
    An FP8 weight's per-row scale goes with its rows: cut like them on column- and vocab-parallel
    tensors, whole on row-parallel ones (their rows are whole; only the input columns are split);
    a per-tensor scale is the same on every rank."""
    module, kind = _module_and_kind(name)
    if kind is None or (kind == "scale" and t.numel() == 1):
        return t
    if module in ("embed_tokens", "lm_head"):
        return _vocab_rows(t, config.vocab_size, shard)
    if module in COLUMN_TARGETS or module in CHECKPOINT_FUSED:
        return _cut_rows(t, module, config, shard)
    if module in ROW_TARGETS:
        if kind == "bias":
            raise ConfigError(f"{name}: a bias on a row-parallel layer is not sharded yet")
        return t[:, shard.rows(t.shape[1])] if kind == "weight" else t
    return t


def shard_checkpoint(named: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                     shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as rank `shard` loads it: each tensor cut as it is read (a rank never holds
    the whole model). Slices are copied so the full tensor can be freed."""
    for name, t in named:
        yield name, shard_tensor(name, t, config, shard).contiguous()


def shard_lora(weights: LoraWeights, config: ModelConfig, shard: Shard) -> LoraWeights:
    """Rank `shard`'s slice of an adapter (S-LoRA): column-parallel targets keep A and cut B's output
    rows (and DoRA's magnitudes with them); row-parallel targets cut A's input columns and keep B
    (and the magnitudes: their rows are whole). `config` is the full model's."""
    modules: dict[tuple[int, str], ModuleWeights] = {}
    for (layer, target), m in weights.modules.items():
        a, b, mag = m.a, m.b, m.magnitude
        if target in ROW_TARGETS:
            a = a[:, shard.rows(a.shape[1])]
        else:
            rows = kv_head_rows(config, shard) if target in ("k_proj", "v_proj") else shard.rows(b.shape[0])
            b = b[rows]
            mag = None if mag is None else mag[rows]
        modules[(layer, target)] = ModuleWeights(a=a.contiguous(), b=b.contiguous(), scaling=m.scaling,
                                                 magnitude=None if mag is None else mag.contiguous())
    return LoraWeights(path=weights.path, rank=weights.rank, alpha=weights.alpha, use_rslora=weights.use_rslora,
                       digest=weights.digest, modules=modules, dora=weights.dora)

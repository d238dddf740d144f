"""Model and engine configuration: a Hugging Face `config.json` read into one frozen dataclass."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}

# The linear layers an adapter may target, and the fused projection each one lives in.
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED_SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class ConfigError(ValueError):
    """A model folder or engine setting that cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """llama3-style frequency scaling (the only long-context scheme we implement)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    qkv_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def slice_sizes(self, fused: str) -> tuple[tuple[int, int], ...]:
        """(in, out) of each output slice of a fused projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "qkv_proj": ((h, self.q_size), (h, self.kv_size), (h, self.kv_size)),
            "o_proj": ((self.q_size, h),),
            "gate_up_proj": ((h, i), (h, i)),
            "down_proj": ((i, h),),
        }[fused]

    def linear_shape(self, target: str) -> tuple[int, int]:
        """(out, in) of an unfused target module, as PEFT and the checkpoint see it."""
        fused, index = LORA_TARGETS[target]
        in_, out = self.slice_sizes(fused)[index]
        return out, in_

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers 5 moved rope settings into `rope_parameters`.
            rope = dict(raw.get("rope_parameters") or {})
            rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
            scaling_raw = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=_rope_scaling(scaling_raw),
                qkv_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks {exc.args[0]!r}") from exc

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{folder} is not a Hugging Face model folder: no config.json")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_scaling(raw: dict | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind != "llama3":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    return RopeScaling(
        rope_type="llama3",
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def rope_inv_freq(config: ModelConfig) -> list[float]:
    """Inverse frequencies per rotary pair, with llama3 scaling applied when configured."""
    dim = config.head_dim
    inv = [1.0 / (config.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    s = config.rope_scaling
    if s.rope_type != "llama3":
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs; names follow vLLM's flags where vLLM has the same knob."""

    max_loras: int = 8  # GPU slots: distinct adapters in one running batch
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    max_loras_per_request: int | None = None  # None: min(4, max_loras)
    max_adapter_bytes: int = 2 << 30  # reject adapter folders larger than this
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: size from memory (CUDA) or a default (CPU)
    kv_cache_memory_fraction: float = 0.9  # of the GPU memory left after weights and slots
    # vLLM's --gpu-memory-utilization: this worker's share of the GPU's memory (weights, slots, KV
    # cache, activations), measured from what was free when it started, so two workers at 0.45 can
    # share a GPU. None: the KV cache takes kv_cache_memory_fraction of what is free.
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64  # running requests
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    aging_steps: int = 32  # a deferred adapter's requests win a slot after waiting this many steps
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    lora_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    # Decode attention: auto (the Triton paged kernel on CUDA, torch on CPU) | torch | triton.
    attention_backend: str = "auto"
    # Decode steps replay a CUDA graph per batch-size bucket (worker/engine/cuda_graphs.py). None: on for
    # CUDA when the attention and LoRA backends are Triton, off otherwise; True on CUDA needs them.
    # (True on CPU runs the graphs' padded static-buffer path without capture: tests.)
    cuda_graphs: bool | None = None
    # Launch each steady-state decode step before reading the previous one's tokens, so the host's
    # bookkeeping overlaps the GPU (worker/engine/async_step.py; vLLM's --async-scheduling). Needs the
    # graph path; everything else (prefill, admissions, preemption) runs synchronously. None: on
    # wherever decode steps replay captured CUDA graphs (docs/benchmarks.md, "Engine on the H200").
    async_scheduling: bool | None = None
    # Before serving, run a long and a short prompt (with a start-up adapter, if any) through
    # prefill and decode, and capture every batch bucket's base decode graph, so the first requests
    # do not pay Triton compiles, cuBLAS kernel selection and captures (H200: a 512-token prompt's
    # TTFT as a process's first request was 732 ms, 19 ms afterwards). None: on for CUDA.
    warmup: bool | None = None
    pinned_adapters: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_loras_per_request is None:
            object.__setattr__(self, "max_loras_per_request", min(4, self.max_loras))
        checks = [
            (self.max_loras >= 1, "max_loras must be >= 1"),
            (1 <= self.max_lora_rank <= 512, "max_lora_rank must be in 1..512"),
            (self.max_cpu_loras >= self.max_loras, "max_cpu_loras must be >= max_loras"),
            (1 <= self.max_loras_per_request <= self.max_loras, "max_loras_per_request must be in 1..max_loras"),
            (self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction must be in (0, 1]"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
             "gpu_memory_utilization must be in (0, 1]"),
            (self.max_num_batched_tokens >= self.block_size, "max_num_batched_tokens must be >= block_size"),
            (self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device must be cpu or cuda[:N]"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype must be auto|float32|bfloat16|float16"),
            (self.lora_backend in ("auto", "torch", "triton"), "lora_backend must be auto|torch|triton"),
            (self.attention_backend in ("auto", "torch", "triton"), "attention_backend must be auto|torch|triton"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

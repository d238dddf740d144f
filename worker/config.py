"""Model and engine configuration: a Hugging Face `config.json` read into one frozen dataclass."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# `architectures[0]` of a config.json -> the family (its `model_type`); worker/models/registry.py
# maps each family to its model class.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES.values())
# Families whose checkpoints (and so their adapters) hold q/k/v and gate/up as one module each.
FUSED_CHECKPOINT_FAMILIES = frozenset({"phi3"})
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # vLLM's --load-format values implemented here
FUSED_ADAPTER_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}

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
    """Frequency scaling: default, llama3, linear, or longrope (Phi-3's; `su` is its older name)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per rotary pair, positions below the original length
    long_factor: tuple[float, ...] = ()  # longrope: per rotary pair, positions from the original length on
    attention_factor: float = 1.0  # longrope: cos and sin are multiplied by it


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
    # Per layer "full_attention" or "sliding_attention" (empty: all full); the window in tokens,
    # a query seeing itself and the window - 1 keys before it (transformers' sliding-window mask).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of the sliding-window layers
    rope_local_scaling: RopeScaling = field(default_factory=RopeScaling)

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
        """(out, in) of an adapter's target module, as PEFT and the checkpoint see it (a fused
        target's out is its slices' together)."""
        outs = []
        for part in (target,) if target in LORA_TARGETS else FUSED_ADAPTER_TARGETS[target]:
            fused, index = LORA_TARGETS[part]
            in_, out = self.slice_sizes(fused)[index]
            outs.append(out)
        return sum(outs), in_

    @property
    def adapter_targets(self) -> dict[str, tuple[str, ...]]:
        """The modules an adapter of this family may target -> the slices (LORA_TARGETS) each covers."""
        if self.model_type in FUSED_CHECKPOINT_FAMILIES:
            return FUSED_ADAPTER_TARGETS
        return {t: (t,) for t in LORA_TARGETS}

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens, None where it attends to the whole context."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = family_of(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_theta, scaling, local_theta, local_scaling = _rope_settings(raw, model_type)
            window = raw.get("sliding_window")
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                qkv_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type.startswith("gemma"))),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                layer_types=_layer_types(raw, model_type, layers),
                sliding_window=None if window is None else int(window),
                qk_norm=model_type in ("qwen3", "gemma3_text"),
                query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
                attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
                final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
                hidden_act=_activation(raw),
                rope_local_theta=local_theta,
                rope_local_scaling=local_scaling,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks {exc.args[0]!r}") from exc

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{folder} is not a Hugging Face model folder: no config.json")
        return cls.from_dict(json.loads(path.read_text()))


def family_of(raw: dict) -> str:
    """The family of a config.json, from `architectures` (when it names one) and `model_type`."""
    supported = ", ".join(f"{a} ({f})" for a, f in ARCHITECTURES.items())
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if archs and not known:
        raise ConfigError(f"architecture {', '.join(map(str, archs))} is not supported (supported: {supported})")
    if known and model_type and model_type != known[0]:
        raise ConfigError(f"config.json names architecture {archs[0]} but model_type {model_type!r} "
                          f"(expected {known[0]!r})")
    family = known[0] if known else model_type
    if family not in SUPPORTED_ARCHITECTURES:
        hint = " (a multimodal Gemma 3: serve its text model, Gemma3ForCausalLM)" if family == "gemma3" else ""
        raise ConfigError(f"model_type {family!r} is not supported{hint} (supported: {supported})")
    return family


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _activation(raw: dict) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act == "gelu_pytorch_tanh" or act == "gelu_new":
        return "gelu_pytorch_tanh"
    if act != "silu":
        raise ConfigError(f"hidden activation {act!r} is not supported (supported: silu, gelu_pytorch_tanh)")
    return act


def _layer_types(raw: dict, family: str, layers: int) -> tuple[str, ...]:
    """Which layers attend through a sliding window: config.json's `layer_types` where it has them,
    else each family's rule (as transformers derives them)."""
    types = raw.get("layer_types")
    if types:
        if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ConfigError(f"layer_types must list full_attention/sliding_attention for each of {layers} layers")
        return tuple(types)
    if raw.get("sliding_window") is None:
        return ()
    if family in ("mistral", "phi3"):
        return ("sliding_attention",) * layers
    if family in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return ()
        first = int(raw.get("max_window_layers", layers))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if family == "gemma2":
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    if family == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    return ()


def _rope_settings(raw: dict, family: str) -> tuple[float, RopeScaling, float | None, RopeScaling]:
    """(theta, scaling) of the full-attention layers, then of Gemma 3's sliding-window layers.

    transformers 5 writes `rope_parameters` (per layer type for Gemma 3); older configs have
    `rope_theta`, `rope_scaling` and Gemma 3's `rope_local_base_freq`."""
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = params, {}
    if "partial_rotary_factor" in full and float(full["partial_rotary_factor"]) != 1.0:
        raise ConfigError(f"partial_rotary_factor {full['partial_rotary_factor']} is not supported (only 1.0)")
    theta = float(full.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling_raw = raw.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    scaling = _rope_scaling(scaling_raw, raw)
    if family != "gemma3_text":
        return theta, scaling, None, RopeScaling()
    local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))
    local_scaling = _rope_scaling(local if local.get("rope_type", "default") != "default" else None, raw)
    return theta, scaling, local_theta, local_scaling


def _rope_scaling(raw: dict | None, config: dict) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(raw["factor"]))
    if kind in ("longrope", "su"):
        original = int(raw.get("original_max_position_embeddings")
                       or config.get("original_max_position_embeddings") or config["max_position_embeddings"])
        factor = raw.get("factor")
        factor = float(factor) if factor is not None else int(config["max_position_embeddings"]) / original
        attention = raw.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling(
            rope_type="longrope", factor=factor, original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in raw["short_factor"]),
            long_factor=tuple(float(f) for f in raw["long_factor"]), attention_factor=float(attention),
        )
    if kind != "llama3":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope)")
    return RopeScaling(
        rope_type="llama3",
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def rope_inv_freq(config: ModelConfig, local: bool = False, long: bool = False) -> list[float]:
    """Inverse frequencies per rotary pair, scaled as configured. local: Gemma 3's sliding-window
    layers (their own base); long: longrope's long factors (else its short ones)."""
    dim = config.head_dim
    theta, s = config.rope_theta, config.rope_scaling
    if local and config.rope_local_theta is not None:
        theta, s = config.rope_local_theta, config.rope_local_scaling
    inv = [1.0 / (theta ** (i / dim)) for i in range(0, dim, 2)]
    if s.rope_type == "linear":
        return [f / s.factor for f in inv]
    if s.rope_type == "longrope":
        factors = s.long_factor if long else s.short_factor
        if len(factors) != len(inv):
            raise ConfigError(f"longrope factors must have head_dim / 2 = {len(inv)} entries, got {len(factors)}")
        return [f / e for f, e in zip(inv, factors)]
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
    # None (`lorafleet worker`'s default) in block_size, max_num_seqs and max_num_batched_tokens: vLLM's
    # default for the device, resolved when the engine starts (worker/engine/device_setup.py,
    # `resolve_device_defaults`); the Python API's defaults are fixed, the same on every device.
    block_size: int | None = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: size from memory (CUDA) or a default (CPU)
    kv_cache_memory_fraction: float = 0.9  # of the GPU memory left after weights and slots
    # vLLM's --gpu-memory-utilization: this worker's share of the GPU's memory (weights, slots, KV
    # cache, activations), measured from what was free when it started, so two workers at 0.45 can
    # share a GPU. None: the KV cache takes kv_cache_memory_fraction of what is free.
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = 64  # running requests
    max_num_batched_tokens: int | None = 2048  # token budget per step (prefill chunks + decodes)
    # With CUDA graphs: the most rows a captured graph takes (vLLM's largest capture size by default,
    # max_cudagraph_capture_size = min(2 x max_num_seqs, 512)): decode steps of up to this many
    # sequences replay a graph, larger ones run eagerly, as in vLLM. While the decoding sequences fit,
    # it is also a step's token budget, so prompt chunks joining them run in the graphs (as rows of
    # one query) instead of an eager step; prompts longer than what is left beside the decodes are
    # chunked over several steps.
    max_graph_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    aging_steps: int = 32  # a deferred adapter's requests win a slot after waiting this many steps
    device: str = "cpu"
    # auto: vLLM's (`lorafleet worker --dtype auto`): the checkpoint's half type on every device,
    # bfloat16 for a float32 one; None (the Python API's default): float32 on CPU, where tests
    # compare with transformers exactly, and auto's choice on CUDA. Or float32 | bfloat16 | float16.
    dtype: str | None = None
    # vLLM's --quantization: "fp8" quantizes an unquantized checkpoint's projections to FP8 (e4m3, a
    # scale per output channel) at load; an FP8 checkpoint is served as FP8 either way (worker/layers/quant.py).
    quantization: str | None = None
    # vLLM's --load-format: auto / safetensors read the folder's safetensors; dummy makes random weights
    # of the checkpoint's names and shapes (worker/models/dummy.py; benchmarks: config and tokenizer only).
    load_format: str = "auto"
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
    # With async scheduling: a step where prompt chunks join the decodes (requests admitted, long
    # prompts chunked) is launched before the one in flight is read, too (worker/engine/async_step.py);
    # off, such a step drains the one in flight and runs synchronously. Off by default until a GPU
    # run has checked it under CUDA graphs and measured it (docs/engine.md).
    async_admission: bool = False
    # Before serving, run a long and a short prompt (with a start-up adapter, if any) through
    # prefill and decode, and capture every batch bucket's base decode graph, so the first requests
    # do not pay Triton compiles, cuBLAS kernel selection and captures (H200: a 512-token prompt's
    # TTFT as a process's first request was 732 ms, 19 ms afterwards). None: on for CUDA.
    warmup: bool | None = None
    pinned_adapters: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0
    # vLLM's --tensor-parallel-size: ranks the model is sharded over (docs/tensor_parallel.md).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_loras_per_request is None:
            object.__setattr__(self, "max_loras_per_request", min(4, self.max_loras))
        checks = [
            (self.max_loras >= 1, "max_loras must be >= 1"),
            (1 <= self.max_lora_rank <= 512, "max_lora_rank must be in 1..512"),
            (self.max_cpu_loras >= self.max_loras, "max_cpu_loras must be >= max_loras"),
            (1 <= self.max_loras_per_request <= self.max_loras, "max_loras_per_request must be in 1..max_loras"),
            (self.block_size in (None, 8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_graph_tokens >= 1, "max_graph_tokens must be >= 1"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction must be in (0, 1]"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
             "gpu_memory_utilization must be in (0, 1]"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= (self.block_size or 1),
             "max_num_batched_tokens must be >= block_size"),
            (self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device must be cpu or cuda[:N]"),
            (self.dtype in (None, "auto", "float32", "bfloat16", "float16"), "dtype must be auto|float32|bfloat16|float16"),
            (self.lora_backend in ("auto", "torch", "triton"), "lora_backend must be auto|torch|triton"),
            (self.attention_backend in ("auto", "torch", "triton"), "attention_backend must be auto|torch|triton"),
            (self.quantization in (None, "fp8"), "quantization must be fp8 or unset"),
            (self.load_format in LOAD_FORMATS, f"load_format {self.load_format!r}: one of {', '.join(LOAD_FORMATS)} "
             "(vLLM's other formats, such as pt, gguf or bitsandbytes, are not implemented)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

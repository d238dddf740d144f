"""FP8 (e4m3) base weights: which checkpoints are FP8, loading them, and quantizing bf16 ones at load.

The decoder's four fused projections a layer (`qkv`, `o`, `gate_up`, `down`) are held as an e4m3fn
weight `[N, K]` beside `<key>_scale`, one fp32 scale per output row, and run through
`lorafleet.kernels.quant.fp8_linear` (`linear` below). Embeddings, norms, `lm_head`, the KV cache
and adapters stay in the model's dtype.

Two sources, one layout:
- an FP8 checkpoint (config.json's `quantization_config`): `quant_method: fp8` (AutoFP8 / vLLM's and
  Hugging Face's FP8 without `weight_block_size`) or `compressed-tensors` with 8-bit float weights
  (llm-compressor's FP8 / FP8_DYNAMIC: `strategy` tensor or channel). The e4m3 values are kept as
  stored; a per-tensor scale becomes the same scale on every row, so fused q/k/v (or gate/up) with
  different scales keep each one. `weight_scale` and `weight_scale_inv` both multiply the stored
  values (the latter is Hugging Face's FineGrainedFP8 name). Activation scales (`input_scale`) are
  not used: activations stay bf16 (W8A16). Block-wise and group-wise scales, other bit widths and
  integer types are refused with a message naming what was found.
- `--quantization fp8` on a bf16 checkpoint: each fused projection quantized per output channel
  (`quantize_rows`) once the model has fused it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lorafleet.kernels.quant.fp8_linear import FP8, dequantize, fp8_linear, quantize_rows
from lorafleet.worker.config import ConfigError

LINEAR_KEYS = ("qkv", "o", "gate_up", "down")  # the fused projections of `LlamaModel.weights`, per layer
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
DROPPED_SUFFIXES = (".input_scale", ".weight_zero_point", ".input_zero_point")
QUANTIZATIONS = ("fp8",)


class QuantizationError(ConfigError):
    """A checkpoint or flag this loader cannot serve; the message says what was found."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """A base projection: `F.linear`, or the W8A16 GEMM when the weight carries FP8 scales."""
    if scale is None:
        return F.linear(x, weight, bias)
    return fp8_linear(x, weight, scale, bias)


def read_quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def checkpoint_scheme(qc: dict[str, Any] | None) -> str | None:
    """config.json's `quantization_config` -> "fp8" (per-tensor or per-channel FP8 weights) or None
    (not quantized); QuantizationError for any layout this loader does not serve."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            raise QuantizationError(f"block-wise FP8 scales (weight_block_size {block}) are not supported: "
                                    "per-tensor or per-channel FP8 checkpoints only")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise QuantizationError(f"FP8 format {fmt!r} is not supported: e4m3 only")
        return "fp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not groups:
            raise QuantizationError("compressed-tensors quantization_config has no config_groups")
        for name, group in groups.items():
            w = (group or {}).get("weights") or {}
            kind = (w.get("type"), w.get("num_bits"), w.get("strategy"))
            if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
                raise QuantizationError(
                    f"compressed-tensors group {name!r} has weights type={kind[0]} num_bits={kind[1]} "
                    f"strategy={kind[2]}: only 8-bit float weights with tensor or channel scales are supported")
        return "fp8"
    raise QuantizationError(f"quantization method {method or '?'!r} is not supported (fp8 and compressed-tensors "
                            "FP8 checkpoints, or --quantization fp8 on an unquantized checkpoint)")


def resolve_scheme(flag: str | None, qc: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(--quantization, the checkpoint's config) -> (scheme or None, whether the checkpoint is
    already quantized). A quantized checkpoint is served as such with or without the flag (vLLM's rule)."""
    if flag is not None and flag not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {flag!r} is not supported; choose from {QUANTIZATIONS}")
    stored = checkpoint_scheme(qc)
    if stored is not None:
        return stored, True
    return flag, False


class _Scales(dict):
    """Per-row scales by short checkpoint name, for replaying a family's `_take_layer`: what it takes
    that has no scale (norms, biases) comes back as a placeholder, so the replay fuses the scales
    exactly as the weights were fused."""

    def pop(self, key: str, *default: Any) -> torch.Tensor:  # noqa: D102 - dict's
        return super().pop(key) if key in self else torch.zeros(1)


def _rows_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A stored scale -> `[rows]` fp32: a scalar (per-tensor) repeated, `[rows]` or `[rows, 1]` as is."""
    s = scale.float().reshape(-1) if scale.dim() <= 1 or scale.shape[-1] == 1 else None
    if s is None or s.numel() not in (1, rows):
        raise QuantizationError(f"{name}: scale of shape {tuple(scale.shape)} for {rows} rows is neither per-tensor "
                                "nor per-channel (block-wise or group-wise scales are not supported)")
    return s.expand(rows).contiguous() if s.numel() == 1 else s.contiguous()


def split_checkpoint(named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, torch.Tensor],
                     rows: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass an FP8 checkpoint's tensors through, holding back its weight scales (into `scales`, by
    the weight's name) and dropping activation scales; `rows` gets each FP8 weight's row count."""
    for name, tensor in named:
        if name.endswith(DROPPED_SUFFIXES):
            continue
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            scales[name[: -len(suffix)] + ".weight"] = tensor
            continue
        if tensor.dtype in (torch.float8_e5m2, getattr(torch, "float8_e4m3fnuz", None)):
            raise QuantizationError(f"{name}: {tensor.dtype} weights are not supported (e4m3fn only)")
        if tensor.dtype == FP8:
            rows[name] = tensor.shape[0]
        yield name, tensor


def load_weights(model: Any, named: Iterable[tuple[str, torch.Tensor]], flag: str | None,
                 qc: dict[str, Any] | None) -> str | None:
    """Load `named` into `model` (a `LlamaModel` family), FP8 as `--quantization` and the checkpoint's
    `quantization_config` say -> the scheme used (None: the model's dtype throughout)."""
    scheme, stored = resolve_scheme(flag, qc)
    if scheme is None:
        model.load_weights(named)
        return None
    raw: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    try:
        model.load_weights(split_checkpoint(named, raw, rows) if stored else named)
    except RuntimeError as exc:
        if "Float8" not in str(exc):
            raise
        raise QuantizationError("a fused projection mixes FP8 and unquantized parts (a quantization `ignore` list "
                                "that covers some of q/k/v or gate/up): not supported") from exc
    w = model.weights
    if stored:
        missing = sorted(set(rows) - set(raw))
        if missing:
            raise QuantizationError(f"FP8 weights without a weight_scale: {missing[:3]}")
        per_row = _Scales()
        for name, scale in raw.items():
            short = _short(name)
            per_row[short] = _rows_scale(scale, rows.get(name, 1), name).to(model.device)
        for key, short in (("embed", "embed_tokens.weight"), ("lm_head", "lm_head.weight")):
            if w[key].dtype == FP8:  # kept in the model's dtype
                w[key] = dequantize(w[key], per_row.pop(short), model.dtype)
        if w["lm_head"].data_ptr() != w["embed"].data_ptr() and model.config.tie_word_embeddings:
            w["lm_head"] = w["embed"]
    for i in range(model.config.num_layers):
        p = f"layers.{i}."
        fused: dict[str, torch.Tensor] = {}
        if stored:
            model._take_layer(per_row, fused, p)
        for key in LINEAR_KEYS:
            t = w[p + key]
            if t.dtype == FP8:
                s = fused.get(p + key)
                if s is None or s.shape != (t.shape[0],):
                    raise QuantizationError(f"layer {i} {key}: no per-row scale matching its {t.shape[0]} rows")
                w[p + key + "_scale"] = s
            elif not stored:  # --quantization fp8 on an unquantized checkpoint
                w[p + key], w[p + key + "_scale"] = quantize_rows(t)
    return scheme


def _short(name: str) -> str:
    for prefix in ("model.",):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name

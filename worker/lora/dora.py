"""DoRA (weight-decomposed LoRA, PEFT `use_dora: true`) as a per-output-feature scale.

PEFT's DoRA forward of a linear layer W (bias b) with magnitude m, in eval mode:

    y = W x + b + (g - 1) ⊙ (W x) + g ⊙ s·B A x,   g = m / ||W + s·B A||_row   (norm detached)
      = g ⊙ (W x + s·B A x) + b

The norm is one number per output feature (a row of W, `torch.linalg.norm(W + s·BA, dim=1)`) and
does not depend on the input, so it is computed once, when the adapter is read (`dora_scales`), and
the slots keep g per output feature per slot (1 for plain LoRA slots). A step then runs the usual
base GEMM and LoRA side path for every token and rescales the rows of DoRA tokens:
y = b + g ⊙ (y + delta - b) (`kernels/lora/dora.py`). A fused module (Phi-3's qkv_proj,
gate_up_proj) has its rows' norms computed from its rows alone, so each slice's g is its rows' part
of the fused module's.

The squared row norm is expanded so that W + s·BA, `[out, in]`, is never formed (`row_norms_sq`):

    ||W_o + s·B_o A||² = ||W_o||² + 2s · Σ_k B[o,k] (W Aᵀ)[o,k] + s² · B_o (A Aᵀ) B_oᵀ

in float32: ||W_o||² is the base's alone and kept per base weight (`BaseNormCache`), the cross term
is one rank-r product of W, the last term rank-r only. Every term is a sum over the input columns,
so the form still sums over a split of them (tensor parallelism's row-parallel shards).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from lorafleet.worker.config import FUSED_SLICES, LORA_TARGETS, ModelConfig
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.weights import LoraWeights, ModuleWeights

# (layer, slice target) -> the base weight of that slice, `[out, in]` (a view of the fused weight).
BaseWeight = Callable[[int, str], torch.Tensor]
# An adapter -> its g per fused projection, computed on the engine loop where the norms need the
# other tensor-parallel ranks' shards of the base weights (worker/engine/parallel.py).
LoopDoraScales = Callable[[LoraWeights], dict[str, torch.Tensor]]


def dora_scales(weights: LoraWeights, model: ModelConfig, base_weight: BaseWeight) -> dict[str, torch.Tensor]:
    """g per fused projection, `[num_layers, out]` float32 on the host (1 where not targeted).

    Computed in float32 on the base weights' device from the adapter's own tensors (before they are
    rounded to the slot dtype); AdapterError if a norm is zero or a scale not finite."""
    norms = {key: sq.clamp_min(0).sqrt() for key, sq in row_norms_sq(weights, base_weight).items()}
    return scales_from_norms(weights, model, norms)


def _need_magnitudes(weights: LoraWeights) -> None:
    for (layer, target), m in sorted(weights.modules.items()):
        if m.magnitude is None:
            raise AdapterError("bad_weights", f"layer {layer} {target}: a DoRA adapter needs a lora_magnitude_vector")


class BaseNormCache:
    """||W_o||² per row of base weights, float32, computed once per weight. A base weight is a view
    of a fused projection the model keeps while it serves (`LlamaModel.base_weight`): entries are
    keyed by that projection, weakly (they go when it is freed), and the view's place in it. A
    weight that is no view (FP8 weights dequantized per call) is not kept."""

    def __init__(self) -> None:
        self._by_base: dict[int, tuple[weakref.ref, dict[tuple, torch.Tensor]]] = {}

    def row_norms_sq(self, w: torch.Tensor) -> torch.Tensor:
        base = w._base
        if base is None:
            return w.float().pow(2).sum(dim=1)
        entry = self._by_base.get(id(base))
        if entry is None or entry[0]() is not base:
            entry = (weakref.ref(base, self._forget(id(base))), {})
            self._by_base[id(base)] = entry
        where = (w.storage_offset(), tuple(w.shape), tuple(w.stride()))
        if where not in entry[1]:
            entry[1][where] = w.float().pow(2).sum(dim=1)
        return entry[1][where]

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        def drop(ref: weakref.ref) -> None:
            if key in self._by_base and self._by_base[key][0] is ref:
                del self._by_base[key]
        return drop


BASE_NORMS = BaseNormCache()


def adapted_row_norms_sq(m: ModuleWeights, w: torch.Tensor, base_sq: torch.Tensor | None = None) -> torch.Tensor:
    """||W + s·B·A||² per row of W `[out, in]`, float32 `[out]` on W's device, without forming
    W + s·B·A (see the module's docstring); base_sq: ||W_o||² if known."""
    dev = w.device
    a = m.a.to(dev, torch.float32)  # [r, in]
    b = m.b.to(dev, torch.float32)  # [out, r]
    wf = w.float()
    wa = wf @ a.T  # [out, r]
    base = wf.pow(2).sum(dim=1) if base_sq is None else base_sq
    cross = (b * wa).sum(dim=1)
    quad = ((b @ (a @ a.T)) * b).sum(dim=1)
    return base + 2 * m.scaling * cross + m.scaling**2 * quad


def row_norms_sq(weights: LoraWeights, base_weight: BaseWeight) -> dict[tuple[int, str], torch.Tensor]:
    """||W + s·B·A||² per output row of each module, `[out]` float32 on the base weights' device:
    the form that sums over a split of the input columns (tensor parallelism's row-parallel layers)."""
    _need_magnitudes(weights)
    out = {}
    for key, m in sorted(weights.modules.items()):
        w = base_weight(*key)
        out[key] = adapted_row_norms_sq(m, w, BASE_NORMS.row_norms_sq(w))
    return out


def scales_from_norms(weights: LoraWeights, model: ModelConfig, norms: dict[tuple[int, str], torch.Tensor],
                      check: bool = True) -> dict[str, torch.Tensor]:
    """g = magnitude / norm laid out per fused projection of `model`, `[num_layers, out]` float32 on
    the host (1 where not targeted); `check`: AdapterError if a scale is not finite."""
    out: dict[str, torch.Tensor] = {}
    for fused in FUSED_SLICES:
        width = sum(size for _, size in model.slice_sizes(fused))
        out[fused] = torch.ones(model.num_layers, width, dtype=torch.float32)
    offsets = {t: sum(s for _, s in model.slice_sizes(LORA_TARGETS[t][0])[: LORA_TARGETS[t][1]]) for t in LORA_TARGETS}
    for (layer, target), norm in sorted(norms.items()):
        m = weights.modules[(layer, target)]
        assert m.magnitude is not None  # _need_magnitudes
        g = (m.magnitude.to(norm.device, torch.float32) / norm).cpu()
        if check and not bool(torch.isfinite(g).all()):
            raise AdapterError("bad_weights", f"layer {layer} {target}: DoRA's scale is not finite "
                               "(a zero weight norm, or a magnitude that overflows)")
        fused, _ = LORA_TARGETS[target]
        start = offsets[target]
        out[fused][layer, start : start + g.numel()] = g
    return out


def prepare_dora(weights: LoraWeights, model: ModelConfig, base_weight: BaseWeight | None,
                 pin: bool) -> dict[str, torch.Tensor]:
    """`dora_scales` for the CPU cache (pinned for the slots' copies on CUDA); refused without
    the base weights."""
    if base_weight is None:
        raise AdapterError("unsupported", "DoRA adapters are not served by this worker (it has no base "
                           "weights to take their norms from)")
    scales = dora_scales(weights, model, base_weight)
    return {k: v.pin_memory() for k, v in scales.items()} if pin else scales


def dora_refusal(adapters: tuple[tuple[str, float], ...], is_dora: Callable[[str], bool]) -> str | None:
    """Why a request's adapters cannot be served with a DoRA adapter among them, or None. DoRA's
    norm is computed once, for the adapter alone at its own scale: beside other adapters or at
    another scale the norm of W + Σ s·B·A would differ."""
    dora = [name for name, _ in adapters if is_dora(name)]
    if not dora:
        return None
    if len(adapters) > 1:
        return f"adapter {dora[0]!r} is a DoRA adapter, which is served only as a request's one adapter"
    if adapters[0][1] != 1.0:
        return f"adapter {dora[0]!r} is a DoRA adapter, which is served only at scale 1.0"
    return None

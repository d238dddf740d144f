"""An adapter's weights in host memory: each module's A and B (`ModuleWeights`), the whole validated
adapter (`LoraWeights`) and, once laid out for the slots, its packed form (`PackedLora`, made by
`packing.pack_weights`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorafleet.worker.lora.digest import Digest


@dataclass(slots=True)
class ModuleWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    magnitude: torch.Tensor | None = None  # [out] DoRA's magnitude vector (None: plain LoRA)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class PackedLora:
    """An adapter laid out as the slots hold it (see packing.py's docstring)."""

    dtype: torch.dtype
    pinned: bool
    chunks: list[torch.Tensor]  # flat buffers holding every piece below, back to back
    # Per module, sorted by k = layer * len(packing.SLICE_ORDER) + column: (k, rank, A rows [r*in], B
    # rank-major rows [r*out]), views into the pieces (for checks and error messages).
    blocks: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    ranks: torch.Tensor  # [num_layers, len(packing.SLICE_ORDER)] int32, 0 = untargeted (pinned with the chunks)
    # The modules as views of the blocks (A [r, in], B [out, r] scaled, scaling 1): what the CPU cache keeps.
    views: dict[tuple[int, str], ModuleWeights] = field(default_factory=dict)
    # (column, half (packing._A/_B), first layer, layers, rank) per piece: adapters of one shape share it,
    # and the slots reuse the copy targets they built for it.
    layout: tuple[tuple[int, int, int, int, int], ...] = ()
    sources: list[torch.Tensor] = field(default_factory=list)  # per piece: [layers, rank, in | out]
    # Laid out on a GPU (`PackPlan.run`): the same pieces there, until `release_gpu` (a fill copies
    # from them instead of over PCIe), complete once `gpu_ready` has passed on the stream that made
    # them; and `host_ready`, after which the host buffers above hold them too (the copy back is
    # not waited for: `wait_host` before reading `chunks`, `blocks` or `views` on the host).
    gpu_sources: list[torch.Tensor] | None = None
    gpu_ready: torch.cuda.Event | None = None
    host_ready: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)

    def wait_host(self) -> None:
        """Block until the host buffers hold the layout (at once unless it was made on a GPU)."""
        if self.host_ready is not None:
            self.host_ready.synchronize()

    def release_gpu(self) -> None:
        """Let the GPU copy of the layout go (the host buffers stay)."""
        self.gpu_sources = None


@dataclass(slots=True)
class LoraWeights:
    """A validated adapter in CPU memory."""

    path: str
    rank: int  # the config's `r` (modules may differ through rank_pattern)
    alpha: float
    use_rslora: bool
    # "sha256:<hex>" over config, NUL, weights, NUL; may still be hashing (`Digest.value` waits).
    digest: Digest
    modules: dict[tuple[int, str], ModuleWeights] = field(default_factory=dict)  # (layer, target) ->
    dora: bool = False  # a DoRA adapter: `dora_scale` holds its per-output-feature scales
    # DoRA: per fused projection (config.FUSED_SLICES), g = magnitude / ||W + s·B·A|| per output row,
    # `[num_layers, out]` float32, 1 where the adapter does not target a slice (worker/lora/dora.py).
    dora_scale: dict[str, torch.Tensor] | None = None
    # The slot layout (`packing.pack_weights`): set by `AdapterRegistry.read`/`insert_cpu`. Once the
    # adapter is in the CPU cache, `modules` are views into it (B scaled, in the slot dtype).
    packed: PackedLora | None = None

    def __post_init__(self) -> None:
        if isinstance(self.digest, str):
            self.digest = Digest(self.digest)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.modules}

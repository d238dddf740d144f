"""Reading an adapter for the registry: validated, laid out for the slots and checked for NaN/Inf.

`AdapterReader.read` does all the per-adapter work, off the engine loop (it touches no registry
state): validation, the digest, and the adapter's CPU-cache copy in exactly the slot layout
(`packing.pack_weights`: pinned on CUDA, B pre-scaled and rank-major, in the slot dtype), checked
for NaN/Inf. With slots on a GPU the file is laid out and checked there, on a side stream, and
copied back into that pinned layout behind the check (the read does not wait for that copy).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial

import torch

from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.lora.adapter import (
    AdapterError,
    LoraWeights,
    all_finite,
    load_adapter,
    non_finite_module,
)
from lorafleet.worker.lora.dora import BaseWeight, prepare_dora
from lorafleet.worker.lora.packing import SLICE_ORDER, PackedLora, PackPlan, plan_pack
from lorafleet.worker.lora.regex_sandbox import RegexSandbox

log = logging.getLogger("lorafleet.worker.lora")
# What parsing a malformed file may raise past the explicit checks (never MemoryError, OSError or
# a CUDA error: those are the worker's, not the adapter's).
_MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError)


class AdapterReader:
    """Reads adapter folders for one registry's slots: its model, limits, slot dtype and device."""

    def __init__(self, model: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
                 device: torch.device | None, base_weight: BaseWeight | None = None, defer_dora: bool = False) -> None:
        """`device`: the CUDA device of the slots (the file is laid out and checked there, and the
        CPU-cache copy pinned), or None (all on the host). `base_weight`: the model's weights,
        for DoRA's norms (None: DoRA adapters are refused). `defer_dora`: DoRA's scales are left to
        the registry's `insert_cpu` on the engine loop (tensor parallelism: a collective), and the
        adapter's own tensors kept for them until then."""
        self.model = model
        self.defer_dora = defer_dora
        self.base_weight = base_weight
        self.engine = engine
        self.dtype = dtype
        self.device = device
        self.pin = device is not None
        # `read` copies the file to the GPU, lays it out and checks it on this stream (never the
        # compute stream) and waits for it alone.
        self.check_stream = torch.cuda.Stream(device) if device is not None else None
        self.regex = RegexSandbox()  # the adapters' regexes, matched off the serving threads

    def read(self, path: str) -> LoraWeights:
        """Validate, read and prepare an adapter folder (safe to run in a thread).

        The weights come back laid out for the slots (`weights.packed`) and checked for NaN/Inf in
        that layout (so an overflow to Inf in the slot dtype is refused too); the digest is computed
        over the same bytes in a thread, which may still run when this returns (`Digest`). With
        slots on a GPU the file goes there as it is read, on a stream of the reader's own (never
        the compute stream), is laid out and checked there, and comes back in the CPU cache's
        pinned layout; `weights.modules` are then already views of that layout. That copy back
        may still run when this returns: `weights.packed.wait_host()` before reading it on the
        host (fills wait for it on the GPU, or use the GPU copy, `packed.gpu_sources`).
        """
        try:
            if self.check_stream is None:
                return load_adapter(path, self.model, self.engine.max_lora_rank, self.engine.max_adapter_bytes,
                                    prepare=self._pack_checked, regex=self.regex)
            device = self.device
            with torch.cuda.device(device), torch.cuda.stream(self.check_stream):
                return load_adapter(path, self.model, self.engine.max_lora_rank, self.engine.max_adapter_bytes,
                                    prepare=self._pack_checked, device=device, regex=self.regex)
        except AdapterError:
            raise
        except _MALFORMED as exc:
            # A malformed file that no check above names: still the adapter's fault, never the
            # worker's (4xx, not 5xx), but logged with its trace as a gap in the checks.
            log.error("adapter %s refused by an unexpected %s", os.path.basename(path), type(exc).__name__,
                      exc_info=True)
            raise AdapterError("malformed", f"the adapter could not be read ({type(exc).__name__})") from None

    def _pack_checked(self, weights: LoraWeights) -> Callable[[], None]:
        """`load_adapter`'s `prepare`: plan the slot layout now (on a GPU the file is still being
        read), lay it out and check it once the bytes are there."""
        plan = plan_pack(weights, self.model.num_layers, self.dtype, self.pin)
        return partial(self._checked, weights, plan)

    def _checked(self, weights: LoraWeights, plan: PackPlan) -> None:
        packed, staged = plan.packed, plan.lay_out()
        if staged is not None:  # laid out on the GPU: checked there, then copied back, waiting for the check only
            flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            flag.copy_(torch.isfinite(staged).all(), non_blocking=True)
            checked = torch.cuda.Event()
            checked.record(torch.cuda.current_stream(staged.device))
            plan.copy_back()
            checked.synchronize()
            finite = bool(flag)
        else:
            finite = self._all_finite(packed)
        if not finite:
            packed.wait_host()
            where = non_finite_module(weights)
            if where is not None:
                raise AdapterError("bad_weights", f"{where}: weights contain NaN or Inf")
            raise AdapterError("bad_weights", f"{_non_finite_block(packed)}: weights overflow {self.dtype} once "
                               "alpha/r is folded in")
        weights.packed = packed
        deferred = weights.dora and self.defer_dora
        if weights.dora and not deferred:  # from the adapter's own tensors, before they give way to the slot layout's
            weights.dora_scale = prepare_dora(weights, self.model, self.base_weight, self.pin)
        if (staged is not None or plan.device_sources is not None) and not deferred:
            weights.modules = packed.views  # let the file's GPU copy go now, not at insert_cpu

    def _all_finite(self, packed: PackedLora) -> bool:
        if not packed.chunks:
            return True
        if self.check_stream is None:
            return all(all_finite(chunk) for chunk in packed.chunks)
        device = self.device
        with torch.cuda.device(device), torch.cuda.stream(self.check_stream):
            try:
                staging = torch.empty(max(c.numel() for c in packed.chunks), dtype=packed.dtype, device=device)
            except torch.cuda.OutOfMemoryError:  # no room for one chunk: check on the host instead
                return all(all_finite(chunk) for chunk in packed.chunks)
            flags = []
            for chunk in packed.chunks:
                part = staging[: chunk.numel()]
                part.copy_(chunk, non_blocking=True)
                flags.append(torch.isfinite(part).all())
            return bool(torch.stack(flags).all().item())  # waits for this stream only


def _non_finite_block(packed: PackedLora) -> str:
    n = len(SLICE_ORDER)
    for k, _r, a, b in packed.blocks:
        if not (all_finite(a) and all_finite(b)):
            return f"layer {k // n} {SLICE_ORDER[k % n]}"
    return "a module"

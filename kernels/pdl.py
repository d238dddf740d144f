"""Programmatic dependent launch (PDL, Hopper and newer): a kernel launched before the one ahead of
it on the stream has finished, that waits for it on the device.

A plain launch starts a kernel's programs only once the kernel ahead of it has completed and its
writes are flushed: in a decode graph that is ~0.3–0.8 µs of idle GPU at each of ~300 kernel
boundaries a step (docs/benchmarks.md, "LoRA kernel tuning"). Launched with
PDL, a kernel's programs are scheduled as the one ahead of it drains and block in `wait()`
(`griddepcontrol.wait`: until every kernel it depends on has completed and its memory is
visible) before they read or write anything. A kernel that calls `release()` lets a PDL launch
behind it be scheduled at once rather than as its programs exit; it changes nothing for a plain
launch behind it.

Used by the LoRA expand (behind its shrink, kernels/lora/launch.py) and, as `ROW_KERNELS` says
for each, by the decoder's row kernels (kernels/layers/rms_norm.py, rope_kv.py, silu_mul.py), the paged
decode attention and the greedy pick. `LORAFLEET_PDL=0` in the environment turns all of it off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lorafleet.kernels import envs
from lorafleet.kernels.envs import interpreting

# Which kernels launch with PDL where it is supported: "always", "with_delta" (only when the
# kernel adds a LoRA delta from the side stream), or "never". Benchmarks set it, then re-capture the
# decode graphs, to time the choices on one engine (bench/decode_ab.py).
ROW_KERNELS: dict[str, str] = {
    "rms_norm": "with_delta",
    "rope_write_kv": "always",
    "silu_mul": "with_delta",
    "attention": "always",
    "greedy": "always",
}


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Hopper or newer, a Triton that can launch with PDL, and not turned off with LORAFLEET_PDL=0."""
    if interpreting() or not torch.cuda.is_available() or not envs.PDL:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    has_option = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_option and hasattr(tl.extra.cuda, "gdc_wait") and torch.cuda.get_device_capability(device_index)[0] >= 9


def supported_for(t: torch.Tensor) -> bool:
    """`pdl_supported` on the device `t` is on (False off CUDA)."""
    return t.is_cuda and pdl_supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


def row_kernel_pdl(kernel: str, t: torch.Tensor, has_delta: bool = False) -> bool:
    """Whether `kernel` (a key of ROW_KERNELS) over `t`'s device launches with PDL now."""
    mode = ROW_KERNELS.get(kernel, "never")
    if mode == "never" or (mode == "with_delta" and not has_delta):
        return False
    return supported_for(t)


def launch_kwargs(pdl: bool) -> dict:
    """A kernel's `PDL` constexpr and, with it on, the launch keyword PDL needs."""
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """With PDL, a kernel's first call: `wait`, then `release` (nothing is read or written before
    the kernel ahead has completed; a PDL launch behind may be scheduled at once)."""
    wait(PDL)
    release(PDL)


@triton.jit
def wait(PDL: tl.constexpr):
    """With PDL: block until the kernels this one depends on have completed (call it first)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """With PDL: let a PDL launch behind this kernel be scheduled now (it still waits in `wait`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

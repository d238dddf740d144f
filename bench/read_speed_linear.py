"""An ideal projection for experiments: the weights (and the step's adapters) read, nothing computed (H200).

`bench/overlap_sweep.py`'s "read speed" variants put `linear_deferred` below in place of
`LlamaModel._linear_deferred`, so every projection of a decode step (not the lm_head) is one launch
of a streaming read: the base weight, plus, with `ONE_LAUNCH`, each active slot's true-rank rows of
every slice's A and B in the same launch (with `ONE_LAUNCH` off, a second launch after the first);
y is zeroed. The outputs are wrong (every hidden state zero); the step's time is that of a kernel
family that reads every byte once at the speed of a plain read and does no math: the best any GEMM
with the LoRA fused into it could do, and, without adapters, the best any base GEMM could do.
Measured: docs/benchmarks-history.md, engine section, "Sixteenth session".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels.lora.meta import LoraMeta

W_BLOCK, W_ITERS = 4096, 4  # a base-weight program reads W_BLOCK * W_ITERS elements (bench/read_bandwidth.py's)
AD_PIECES, AD_BLOCK = 4, 4096  # programs a (chunk, slice, A or B), elements a load
ONE_LAUNCH = True


@triton.jit
def _read_block(ptr, lo, hi, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(lo, hi, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < hi, other=0.0).to(tl.float32)
    return tl.sum(acc)


@triton.jit
def _read_linear_kernel(
    w_ptr, w_numel, y_ptr, y_numel, sink_ptr,
    a0, a1, a2, b0, b1, b2, stride_a0, stride_a1, stride_a2, stride_b0, stride_b1, stride_b2,
    in_dim, out0, out1, out2, ranks_ptr, stride_rs, chunk_slot_ptr, w_programs,
    W_BLOCK: tl.constexpr, W_ITERS: tl.constexpr, AD_PIECES: tl.constexpr, AD_BLOCK: tl.constexpr,
    Y_PROGRAMS: tl.constexpr, PROBE: tl.constexpr,
):
    pid = tl.program_id(0)
    s = pid.to(tl.float32) * 0.0
    if pid < w_programs:
        if pid < Y_PROGRAMS:  # the first programs zero y
            share = tl.cdiv(tl.cdiv(y_numel, Y_PROGRAMS), 1024) * 1024
            for z in range(pid * share, tl.minimum(pid * share + share, y_numel), 1024):
                offs_z = z + tl.arange(0, 1024)
                tl.store(y_ptr + offs_z, tl.zeros((1024,), dtype=y_ptr.dtype.element_ty), mask=offs_z < y_numel)
        lo = pid.to(tl.int64) * (W_BLOCK * W_ITERS)
        s = _read_block(w_ptr, lo, tl.minimum(lo + W_BLOCK * W_ITERS, w_numel), W_BLOCK)
    else:
        q = pid - w_programs  # (chunk, slice, A or B, piece)
        piece = q % AD_PIECES
        ab = (q // AD_PIECES) % 2
        j = (q // (2 * AD_PIECES)) % 3
        chunk = q // (6 * AD_PIECES)
        slot = tl.load(chunk_slot_ptr + chunk)
        if slot >= 0:
            if j == 0:
                a, b, sa, sb, out = a0, b0, stride_a0, stride_b0, out0
            elif j == 1:
                a, b, sa, sb, out = a1, b1, stride_a1, stride_b1, out1
            else:
                a, b, sa, sb, out = a2, b2, stride_a2, stride_b2, out2
            if out > 0:
                rank = tl.load(ranks_ptr + j * stride_rs + slot)
                if ab == 0:
                    base, total = a + slot.to(tl.int64) * sa, rank * in_dim
                else:
                    base, total = b + slot.to(tl.int64) * sb, rank * out
                piece_len = tl.cdiv(tl.cdiv(total, AD_PIECES), AD_BLOCK) * AD_BLOCK
                lo = piece * piece_len
                s = _read_block(base, lo, tl.minimum(lo + piece_len, total), AD_BLOCK)
    if PROBE:  # tests: every program's sum at sink[program]
        tl.store(sink_ptr + pid, s)
    elif s == 123456789.0:  # never (keeps the loads)
        tl.store(sink_ptr, s)


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sink, int32 -1) for `device`, made once: not a fill launch in every captured projection."""
    if device not in _SCRATCH:
        _SCRATCH[device] = (torch.zeros(1, dtype=torch.float32, device=device),
                            torch.full((1,), -1, dtype=torch.int32, device=device))
    return _SCRATCH[device]


def read_linear(x: torch.Tensor, w: torch.Tensor, lora_a=None, lora_b=None, ranks_device=None,
                meta: LoraMeta | None = None, probe: torch.Tensor | None = None) -> torch.Tensor:
    """`[T, out]` zeros, after reading w (and, with lora_a/lora_b/meta, the step's adapter rows).
    probe: fp32, zeroed, one entry a program: takes each program's sum of what it read (tests)."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    sink, none = _scratch(x.device)
    sink = sink if probe is None else probe
    w_programs = triton.cdiv(w.numel(), W_BLOCK * W_ITERS)
    chunks = 0 if meta is None else meta.grid_chunks
    if lora_a is not None:
        if len(lora_a) > 3 or any(b.stride(1) != 1 for b in lora_b):
            raise ValueError("at most 3 slices, B rank-major (the slot pool's)")
        a = list(lora_a) + [lora_a[0]] * (3 - len(lora_a))
        b = list(lora_b) + [lora_b[0]] * (3 - len(lora_b))
        outs = [t.shape[1] for t in lora_b] + [0] * (3 - len(lora_b))
        ranks, stride_rs, chunk_slot = ranks_device, ranks_device.stride(0), meta.chunk_slot
    else:
        a = b = [w] * 3  # slots and ranks: int32, as the kernel loads them
        outs, ranks, stride_rs, chunk_slot, chunks = [0, 0, 0], none, 0, none, 0

    def launch(w_progs: int, ad_progs: int, zero: bool) -> None:
        out = sink if probe is None or zero else sink[w_programs:]  # a second launch's programs after the first's
        _read_linear_kernel[(w_progs + ad_progs,)](
            w, w.numel(), y, y.numel() if zero else 0, out, *a, *b, *(t.stride(0) for t in a),
            *(t.stride(0) for t in b), x.shape[1], *outs, ranks, stride_rs, chunk_slot, w_progs,
            W_BLOCK=W_BLOCK, W_ITERS=W_ITERS, AD_PIECES=AD_PIECES, AD_BLOCK=AD_BLOCK, Y_PROGRAMS=64, num_warps=8,
            PROBE=probe is not None,
        )

    ad_programs = chunks * 6 * AD_PIECES
    if ONE_LAUNCH or ad_programs == 0:
        launch(w_programs, ad_programs, True)
    else:
        launch(w_programs, 0, True)
        launch(0, ad_programs, False)  # (a probe's entries: this launch's programs follow the first's)
    return y


def linear_deferred(self, x, layer, fused, meta, graph=False, beside=True):
    """`LlamaModel._linear_deferred` with the projection replaced by `read_linear` (no delta)."""
    key = f"layers.{layer}.{fused.removesuffix('_proj')}"
    w = self.weights[key]
    if meta is not None and (graph or not meta.empty) and self.lora is not None:
        s = self.lora.layers[layer].get(fused)
        if s is not None:
            return read_linear(x, w, s.lora_a, s.lora_b, s.ranks_device, meta), None
    return read_linear(x, w), None

"""W8A16 linear: FP8 (e4m3) weights with one fp32 scale per output channel, bf16 activations.

    y[m, n] = scale[n] * sum_k x[m, k] * float(w[n, k])  (+ bias[n])

`fp8_linear` is the one entry point (the ops switch): the torch reference on the CPU, and on CUDA the
Triton kernel for decode-sized steps (M up to the tuning's `prefill_min_m`) and the tuning's prefill
path above it. The kernel is memory-bound at decode sizes: it streams FP8 weight tiles (half the
bytes of bf16), converts them to bf16 in registers, accumulates the products in fp32 and applies the
per-channel scale once on the output tile (a scale per output channel commutes with the sum over K).
Small M leaves few programs over N, so the tuning may split K: each split adds its scaled partial sum
into a zeroed fp32 output with atomics, cast to the activation dtype after. Launch configurations are
data per device (`kernels/quant/tuning.py`). Every launch takes its tensors' addresses as they are and
allocates with torch, so it is captured into CUDA graphs like any other op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels.envs import interpreting
from lorafleet.kernels.quant.tuning import Fp8Tuning, LaunchConfig, active_tuning

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_rows(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` weight -> (`[N, K]` e4m3fn, `[N]` fp32 scales): each row scaled so its largest
    magnitude maps to FP8_MAX, rounded to nearest (an all-zero row gets scale 1). `amax` `[N]`: the
    rows' largest magnitudes when `w` holds only some of each row's columns (a tensor-parallel shard)."""
    wf = w.float()
    if amax is None:
        amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[N, K]` e4m3fn and `[N]` scales -> the weight in `dtype` (rounded once, from fp32)."""
    return (w.float() * scale.float()[:, None]).to(dtype)


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x `[M, K]`, w `[N, K]` e4m3fn, scale `[N]` -> `[M, N]` in x's dtype, computed in fp32."""
    y = (x.float() @ w.float().t()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _w8a16_kernel(
    # pointers
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K,
    # strides (the last dimension of each is contiguous)
    stride_xm, stride_wn, stride_om,
    # meta-parameters
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """x `[M, K]` bf16/fp16, w `[N, K]` e4m3fn, scale `[N]` fp32, bias `[N]`, out `[M, N]` (fp32 when
    SPLIT_K > 1: partial sums are added into it). Grid: (tiles of M x tiles of N, SPLIT_K).

    Semantics:
        for each (m-tile, n-tile, split s): acc = sum over k-tiles s, s + SPLIT_K, ... of
            x[m-tile, k-tile] @ bf16(w[n-tile, k-tile])^T   (fp32)
        acc *= scale[n-tile]; acc += bias (split 0 only); out = acc (or out += acc when split)
    SWAP_AB takes the same sum as bf16(w[n-tile, k-tile]) @ x[m-tile, k-tile]^T into a `[BLOCK_N,
    BLOCK_M]` accumulator stored transposed: at a few rows the weight tile fills the MMA's M side.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: programs running together share x rows and weight columns in L2 (prefill sizes).
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SWAP_AB:
        # (W x^T)^T: the weight tile [BLOCK_N, BLOCK_K] (K contiguous, as stored) is the left operand,
        # the activations' [BLOCK_K, BLOCK_M] the right; the accumulator is the output tile transposed.
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]: x^T's tile
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
            else:
                in_k = (k - pid_k * BLOCK_K + offs_k) < K
                w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=mask_m[None, :] & in_k[:, None], other=0.0)
            if DOT_F32:
                acc_t += tl.dot(w.to(tl.float32), x.to(tl.float32))
            else:
                acc_t = tl.dot(w.to(x.dtype), x, acc_t)
            x_ptrs += BLOCK_K * SPLIT_K
            w_ptrs += BLOCK_K * SPLIT_K
        acc_t *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        if HAS_BIAS:
            if pid_k == 0:
                acc_t += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out_ptrs_t = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        mask_t = mask_n[:, None] & mask_m[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs_t, acc_t.to(out_ptr.dtype.element_ty), mask=mask_t)
        else:
            tl.atomic_add(out_ptrs_t, acc_t, mask=mask_t)
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: w^T's tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                in_k = (k - pid_k * BLOCK_K + offs_k) < K
                x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=mask_n[None, :] & in_k[:, None], other=0.0)
            if DOT_F32:  # the interpreter's dot is wrong in bf16: fp32 there (exact for FP8 values)
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)  # e4m3 -> bf16 is exact: the dequantization is a cast
            x_ptrs += BLOCK_K * SPLIT_K
            w_ptrs += BLOCK_K * SPLIT_K
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out_ptrs, acc, mask=mask)


def fp8_linear_triton(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    config: LaunchConfig | None = None, tuning: Fp8Tuning | None = None,
) -> torch.Tensor:
    """The Triton kernel: x `[M, K]`, w `[N, K]` e4m3fn, scale `[N]` fp32 -> `[M, N]` in x's dtype.
    `config`: this launch (default: the tuning's pick for the shape)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] must agree on K: {tuple(x.shape)} vs {tuple(w.shape)}")
    if w.dtype != FP8 or scale.shape != (w.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"w must be {FP8} with a [N] fp32 scale, got {w.dtype} and {scale.dtype} {tuple(scale.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    c = config or (tuning or active_tuning()).pick(m, n, k)
    split = c.split_k if k >= c.block_k * c.split_k else 1
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1 else torch.empty(
        (m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), split)
    _w8a16_kernel[grid](
        x, w, scale, bias if bias is not None else scale, out,
        m, n, k,
        x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        SPLIT_K=split, GROUP_M=8, EVEN_K=k % c.block_k == 0, DOT_F32=interpreting(), SWAP_AB=c.swap_ab,
        num_warps=c.warps, num_stages=c.stages,
    )
    return out.to(x.dtype) if split > 1 else out


def fp8_linear_dequant(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill by cast-then-GEMM: the e4m3 weight cast to x's dtype (exact), one BLAS GEMM, the
    per-channel scale (and bias) applied to its `[M, N]` output."""
    y = torch.mm(x, w.to(x.dtype).t()).mul_(scale.to(x.dtype))
    return y if bias is None else y.add_(bias)


def fp8_linear_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill on FP8 tensor cores: x quantized per row on the fly (W8A8, dynamic), `torch._scaled_mm`
    with row-wise scales on both sides."""
    m = x.shape[0]
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, -m % 16))  # cuBLASLt's FP8 GEMM wants M a multiple of 16
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [M, 1]
    xq = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale[None, :].float(), bias=bias, out_dtype=x.dtype)
    return y[:m]


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               tuning: Fp8Tuning | None = None) -> torch.Tensor:
    """x `[..., K]` -> `[..., N]`: the torch reference on the CPU; on CUDA the Triton kernel up to the
    tuning's `prefill_min_m` rows and its prefill path above."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if not x2.is_cuda:
        y = fp8_linear_ref(x2, w, scale, bias)
    else:
        t = tuning or active_tuning()
        if x2.shape[0] <= t.prefill_min_m or t.prefill == "triton":
            y = fp8_linear_triton(x2, w, scale, bias, tuning=t)
        elif t.prefill == "scaled_mm":
            y = fp8_linear_scaled_mm(x2, w, scale, bias)
        else:
            y = fp8_linear_dequant(x2, w, scale, bias)
    return y.reshape(*lead, w.shape[0])

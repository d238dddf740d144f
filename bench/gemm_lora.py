"""An experiment: the decode GEMM and its LoRA in one Triton kernel (y = x Wᵀ + Σ scale·B(A x)).

Issue 9's 64-adapter target needs the adapters' 5 GiB read more efficiently than the cuBLASLt GEMMs
read the base weights (docs/benchmarks.md, "Fifteenth session"): beside those GEMMs even a side
path that only reads the bytes reaches 0.76x. This kernel reads the adapters inside the GEMM's own
launch instead, so they share its ramp and tail:

  shrink  the step's (token, slice, K piece) units, spread over every program first: each unit
          reads its slot's true-rank rows of A for one K piece and stores scale·(A x) partials
          (`s_part[piece, token, slice, :]`, fp32; summed in a fixed order, so deterministic);
  GEMM    (tile, K split) items, a `[T, BLOCK_N]` tile of x Wᵀ over one K split each; a tile's
          splits store fp32 partials and the last to finish (a per-tile counter) sums them in
          split order;
  expand  that finisher adds each token's Σ_r s[t, r]·B[slot_t, r, n] (B rank-major, `[S, R, N]`
          with the slices side by side along N) and stores y in the output dtype.

One launch (`phases="fused"`) needs every program resident at once: the finishers wait, on a
counter, for the whole grid's shrink units (a grid barrier; the grid is at most one program an
SM, and a program's first K loop runs before it waits). `phases="split"` is two plain launches
(shrink, then GEMM with the expand), which the interpreter can run (it runs programs one after
another, so a barrier would never open); `lora=None` is the GEMM alone.

Bench only (`bench/fused_gemm_bound.py` times it against cuBLASLt + the engine's side path): one
adapter a token (k = 1), T a power of two ≤ 128, N a multiple of BLOCK_N, K of BLOCK_K·split, B
per projection as one `[S, R, N]` stack. The engine does not use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 128
    split: int = 1  # K splits a tile
    stages: int = 4
    warps: int = 4
    block_ks: int = 256  # the shrink's K step
    pieces: int = 4  # the shrink's K pieces a (token, slice)
    r_chunk: int = 4  # ranks the expand sums at once


@dataclass(slots=True)
class FusedLora:
    """One projection's LoRA, laid out for the fused kernel (k = 1)."""

    a: torch.Tensor  # [S, J, R, K] bf16: slice j's A rows
    b: torch.Tensor  # [S, R, N] bf16: the slices' B side by side along N (rank-major)
    slices: tuple[int, ...]  # out width of each slice (sum = N)
    token_slot: torch.Tensor  # [T] int32, -1 = none
    token_scale: torch.Tensor  # [T] float32
    ranks: torch.Tensor  # [S] int32 true rank (every slice)


@dataclass(slots=True)
class Workspace:
    """Scratch one call site reuses across launches (zeroed once; the kernel leaves it reusable)."""

    s_part: torch.Tensor  # [pieces, T, J, R] fp32
    partials: torch.Tensor  # [tiles, split, T, BLOCK_N] fp32
    tile_count: torch.Tensor  # [tiles] int32, back to 0 after every launch
    barrier: torch.Tensor  # [1] int64, grows by the grid size every fused launch


def new_workspace(t: int, n: int, lora: FusedLora | None, cfg: GemmConfig, device) -> Workspace:
    j, r = (lora.a.shape[1], lora.a.shape[2]) if lora is not None else (1, 1)
    tiles = n // cfg.block_n
    return Workspace(
        s_part=torch.zeros(cfg.pieces, t, j, r, device=device, dtype=torch.float32),
        partials=torch.zeros(tiles, cfg.split, t, cfg.block_n, device=device, dtype=torch.float32),
        tile_count=torch.zeros(tiles, device=device, dtype=torch.int32),
        barrier=torch.zeros(1, device=device, dtype=torch.int64),
    )


@triton.jit
def _shrink_units(x_ptr, a_ptr, s_ptr, slot_ptr, scale_ptr, rank_ptr, K, K_PIECE, stride_as, first, step,
                  T: tl.constexpr, J: tl.constexpr, R: tl.constexpr, PIECES: tl.constexpr,
                  BLOCK_KS: tl.constexpr):
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_KS)
    for u in range(first, PIECES * T * J, step):  # unit = (piece, token, slice)
        j = u % J
        t = (u // J) % T
        piece = u // (J * T)
        slot = tl.load(slot_ptr + t)
        safe = tl.maximum(slot, 0)
        rank = tl.where(slot >= 0, tl.load(rank_ptr + safe), 0)
        a_rows = a_ptr + safe.to(tl.int64) * stride_as + (j * R + offs_r)[:, None].to(tl.int64) * K
        live = (offs_r < rank)[:, None]
        acc = tl.zeros((R, BLOCK_KS), dtype=tl.float32)
        k0 = piece * K_PIECE
        for k in range(k0, k0 + K_PIECE, BLOCK_KS):
            av = tl.load(a_rows + (k + offs_k)[None, :], mask=live, other=0.0)
            xv = tl.load(x_ptr + t * K + k + offs_k)
            acc += av.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(s_ptr + ((piece * T + t) * J + j) * R + offs_r, tl.sum(acc, 1) * tl.load(scale_ptr + t))


@triton.jit
def _k_split(x_ptr, w_ptr, tile, k_lo, K, K_SPLIT, T: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    offs_m = tl.arange(0, T)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    xp = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    wp = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros((T, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        xv = tl.load(xp)
        wv = tl.load(wp)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            acc = tl.dot(xv.to(tl.float32), tl.trans(wv.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(wv), acc)
        xp += BLOCK_K
        wp += BLOCK_K
    return acc


@triton.jit
def _finish_tile(acc, tile, y_ptr, b_ptr, s_ptr, slot_ptr, rank_ptr, N, n1, n2, stride_bs,
                 T: tl.constexpr, J: tl.constexpr, R: tl.constexpr, PIECES: tl.constexpr,
                 BLOCK_N: tl.constexpr, R_CHUNK: tl.constexpr, LORA: tl.constexpr):
    offs_m = tl.arange(0, T)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if LORA:
        n0 = tile * BLOCK_N
        j = (n0 >= n1).to(tl.int32) + (n0 >= n2).to(tl.int32)
        slot = tl.load(slot_ptr + offs_m)
        safe = tl.maximum(slot, 0)
        rank = tl.where(slot >= 0, tl.load(rank_ptr + safe), 0)
        b_tok = b_ptr + safe.to(tl.int64) * stride_bs
        for r0 in tl.static_range(0, R, R_CHUNK):
            offs_r = r0 + tl.arange(0, R_CHUNK)
            sv = tl.zeros((T, R_CHUNK), dtype=tl.float32)
            for piece in tl.static_range(PIECES):
                sv += tl.load(s_ptr + ((piece * T + offs_m[:, None]) * J + j) * R + offs_r[None, :])
            live = offs_r[None, :] < rank[:, None]
            bp = b_tok[:, None, None] + offs_r[None, :, None] * N + offs_n[None, None, :]
            bv = tl.load(bp, mask=live[:, :, None], other=0.0)
            acc += tl.sum(sv[:, :, None] * bv.to(tl.float32), axis=1)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemm_lora_kernel(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, s_ptr, slot_ptr, scale_ptr, rank_ptr,
    part_ptr, count_ptr, barrier_ptr,
    N, K, n1, n2, K_PIECE, K_SPLIT, ITEMS, stride_as, stride_bs,
    T: tl.constexpr, J: tl.constexpr, R: tl.constexpr, PIECES: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr, R_CHUNK: tl.constexpr,
    LORA: tl.constexpr, SHRINK: tl.constexpr, GEMM: tl.constexpr, BARRIER: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if LORA and SHRINK:
        _shrink_units(x_ptr, a_ptr, s_ptr, slot_ptr, scale_ptr, rank_ptr, K, K_PIECE, stride_as, pid, grid,
                      T, J, R, PIECES, BLOCK_KS)
    target = 0
    if BARRIER:  # arrive: this program's s partials are stored
        old = tl.atomic_add(barrier_ptr, 1, sem="release")
        target = (old // grid + 1) * grid
    if GEMM:
        waited = pid < 0  # a tensor flag: the barrier is waited for once
        offs_m = tl.arange(0, T)
        offs_c = tl.arange(0, BLOCK_N)
        for item in range(pid, ITEMS, grid):  # item = (tile, K split)
            tile = item // SPLIT
            split = item % SPLIT
            acc = _k_split(x_ptr, w_ptr, tile, split * K_SPLIT, K, K_SPLIT, T, BLOCK_N, BLOCK_K, UPCAST)
            last = True
            if SPLIT > 1:
                parts = part_ptr + tile.to(tl.int64) * (SPLIT * T * BLOCK_N) + offs_m[:, None] * BLOCK_N + offs_c[None, :]
                tl.store(parts + split * (T * BLOCK_N), acc)
                done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
                last = done == SPLIT - 1
                if last:  # sum the splits in order (deterministic), reset the counter for the next launch
                    acc = tl.zeros((T, BLOCK_N), dtype=tl.float32)
                    for s in tl.static_range(SPLIT):
                        acc += tl.load(parts + s * (T * BLOCK_N), cache_modifier=".cg")
                    tl.store(count_ptr + tile, 0)
            if last:
                if BARRIER and not waited:
                    while tl.atomic_add(barrier_ptr, 0, sem="acquire") < target:
                        pass
                    waited = pid >= 0
                _finish_tile(acc, tile, y_ptr, b_ptr, s_ptr, slot_ptr, rank_ptr, N, n1, n2, stride_bs,
                             T, J, R, PIECES, BLOCK_N, R_CHUNK, LORA)


def _grid_limit(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_lora(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, lora: FusedLora | None, ws: Workspace,
              cfg: GemmConfig, phases: str = "fused", programs: int | None = None) -> None:
    """y = x wᵀ (+ the LoRA), x `[T, K]`, w `[N, K]`, y `[T, N]`; phases "fused" (one launch, grid
    barrier) or "split" (two launches). programs: the grid (default: one an SM, at most the items)."""
    t, k = x.shape
    n = w.shape[0]
    if t & (t - 1) or t > 128 or n % cfg.block_n or k % (cfg.block_k * cfg.split):
        raise ValueError(f"unsupported shape T={t} N={n} K={k} for {cfg}")
    items = n // cfg.block_n * cfg.split
    upcast = x.device.type != "cuda"
    if lora is None:
        a = b = s = slot = scale = rank = x  # unused
        j, r, stride_as, stride_bs, n1, n2, k_piece = 1, 1, 0, 0, n, n, k
    else:
        a, b, s = lora.a, lora.b, ws.s_part
        slot, scale, rank = lora.token_slot, lora.token_scale, lora.ranks
        j, r = a.shape[1], a.shape[2]
        bounds = [sum(lora.slices[: i + 1]) for i in range(len(lora.slices))] + [n, n]
        n1, n2 = bounds[0], bounds[1]
        stride_as, stride_bs = a.stride(0), b.stride(0)
        k_piece = k // cfg.pieces
        if k_piece % cfg.block_ks or any(o % cfg.block_n for o in lora.slices):
            raise ValueError(f"K piece {k_piece} or slices {lora.slices} do not fit {cfg}")

    def launch(grid: int, shrink: bool, gemm: bool, barrier: bool) -> None:
        _gemm_lora_kernel[(grid,)](
            x, w, y, a, b, s, slot, scale, rank, ws.partials, ws.tile_count, ws.barrier,
            n, k, n1, n2, k_piece, k // cfg.split, items, stride_as, stride_bs,
            T=t, J=j, R=r, PIECES=cfg.pieces, SPLIT=cfg.split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_KS=cfg.block_ks, R_CHUNK=min(cfg.r_chunk, r), LORA=lora is not None, SHRINK=shrink,
            GEMM=gemm, BARRIER=barrier, UPCAST=upcast, num_warps=cfg.warps, num_stages=cfg.stages,
        )

    grid = programs or min(items, _grid_limit(x.device))
    if lora is None:
        launch(grid, False, True, False)
    elif phases == "fused":
        if grid > _grid_limit(x.device):
            raise ValueError(f"a fused launch needs every program resident: {grid} programs")
        launch(grid, True, True, True)
    elif phases == "split":
        units = cfg.pieces * t * j
        launch(min(units, _grid_limit(x.device) * 4), True, False, False)
        launch(grid, False, True, False)
    else:
        raise ValueError(f"phases must be fused or split, got {phases!r}")


def gemm_lora_reference(x: torch.Tensor, w: torch.Tensor, lora: FusedLora | None) -> torch.Tensor:
    """fp32 x wᵀ + Σ scale·B(A x), per token."""
    y = x.float() @ w.float().T
    if lora is None:
        return y
    col = 0
    for j, out in enumerate(lora.slices):
        for t in range(x.shape[0]):
            slot = int(lora.token_slot[t])
            if slot < 0:
                continue
            r = int(lora.ranks[slot])
            h = lora.a[slot, j, :r].float() @ x[t].float() * float(lora.token_scale[t])
            y[t, col : col + out] += lora.b[slot, :r, col : col + out].float().T @ h
        col += out
    return y

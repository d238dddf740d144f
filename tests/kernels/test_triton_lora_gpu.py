"""Triton LoRA kernels on a CUDA GPU: the `@pytest.mark.gpu` cases (skipped without one).

bf16 at the seed model's shapes against `add_lora_reference`, wide K tiles (the shrink and expand a
row at a time too), CUDA-graph replay with new metadata, and the side path: `linear_lora_deferred`
with the LoRA on a side stream beside the base GEMM. The helpers are lora_cases.py's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lorafleet.kernels.lora.config import LoraKernelConfig
from lorafleet.kernels.lora.launch import add_lora_triton
from lorafleet.kernels.lora.linear import linear_lora_deferred
from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.kernels.lora.ops import add_lora
from lorafleet.kernels.pdl import pdl_supported
from tests.kernels.lora_cases import HAS_CUDA, LAYOUTS, make_weights, run_both

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Seed model shapes (hidden 4096, kv 1024, mlp 14336): (d_in, output slices).
MODULES = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.parametrize("tokens,k,adapters", [(1, 1, 1), (64, 1, 64), (64, 2, 16), (300, 1, 8)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_real_shapes(module: str, tokens: int, k: int, adapters: int, layout: str) -> None:
    """bf16 at real shapes: ‖Δtriton − Δref‖ / ‖Δref‖ ≤ 1e-2 on the LoRA delta (Δ = y_after − y_before).

    The reference accumulates in fp32 from the same bf16 weights; the kernel rounds the rank-r
    intermediate to bf16 before the expand, as the bf16 tensor cores need, which gives ~3e-3.
    """
    d_in, outs = MODULES[module]
    slots = 64
    rank_cycle = [16, 8, 64, 0, 16, 1, 7, 16]
    ranks = [[rank_cycle[(s + i) % len(rank_cycle)] for s in range(slots)] for i in range(len(outs))]
    g = torch.Generator().manual_seed(tokens + adapters)
    chosen = torch.randperm(slots, generator=g)[:adapters]
    token_slots = chosen[torch.randint(0, adapters, (tokens, k), generator=g)]
    token_slots[::5, -1] = -1
    if k > 1:  # a token never lists the same adapter twice
        token_slots[:, 1] = torch.where(token_slots[:, 1] == token_slots[:, 0], -1, token_slots[:, 1])
    y0, y_ref, y_tri = run_both(
        7, tokens, k, d_in, outs, ranks, token_slots, torch.bfloat16, device="cuda", layout=layout
    )
    err = rel_err(y_tri.float() - y0.float(), y_ref.float() - y0.float())
    assert err < 1e-2, err


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.parametrize("block_k,stages,rows,expand_rows", [(256, 3, False, False), (512, 2, False, False),
                                                             (1024, 2, False, False),
                                                             (256, 3, True, False), (512, 3, True, False),
                                                             (256, 3, True, True)])
def test_bf16_wide_k_tiles(module: str, block_k: int, stages: int, rows: bool, expand_rows: bool) -> None:
    """The shrink with K tiles that cover most of a split, or a row at a time (one token a chunk, 64
    adapters, ranks mixed), the expand too: same tolerance as above, on every module, empty splits
    included (down, split 8)."""
    d_in, outs = MODULES[module]
    slots, tokens = 64, 64
    rank_cycle = [16, 8, 0, 16, 1, 7]
    ranks = [[rank_cycle[(s + i) % len(rank_cycle)] for s in range(slots)] for i in range(len(outs))]
    token_slots = torch.randperm(slots, generator=torch.Generator().manual_seed(block_k))[:tokens, None]
    config = LoraKernelConfig(split_k=8 if d_in > 4096 else 4, block_k=block_k, block_n=256 if expand_rows else 128,
                              n_per_prog=256 if expand_rows else 512, shrink_warps=2, num_stages=stages,
                              shrink_rows=rows, expand_rows=expand_rows)
    y0, y_ref, y_tri = run_both(3, tokens, 1, d_in, outs, ranks, token_slots, torch.bfloat16, config=config,
                                device="cuda", layout="rank_major")
    err = rel_err(y_tri.float() - y0.float(), y_ref.float() - y0.float())
    assert err < 1e-2, err


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_cuda_graph_replay_with_new_metadata(pdl: bool) -> None:
    """Capture once, then replay with other steps' metadata copied into the captured buffers;
    with and without programmatic dependent launch (the expand starts while the shrink runs)."""
    if pdl and not pdl_supported(torch.cuda.current_device()):
        pytest.skip("no programmatic dependent launch here (needs sm_90+ and a Triton with launch_pdl)")
    tokens, k, slots, d_in, outs = 64, 2, 16, 4096, [4096, 1024, 1024]
    ranks = [[16] * slots, [8] * slots, [16 if s % 2 else 0 for s in range(slots)]]
    g = torch.Generator().manual_seed(3)
    lora_a, lora_b = make_weights(g, slots, 16, d_in, outs, ranks, torch.bfloat16, "cuda", "rank_major")
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, d_in, generator=g).to("cuda", torch.bfloat16)
    y = torch.zeros(tokens, sum(outs), device="cuda", dtype=torch.bfloat16)

    def step_meta(seed: int):
        gg = torch.Generator().manual_seed(seed)
        return build_lora_meta(
            torch.randint(-1, slots, (tokens, k), generator=gg),
            torch.rand(tokens, k, generator=gg),
            slots,
            "cuda",
        )

    static = step_meta(0)
    add_lora_triton(y, x, lora_a, lora_b, ranks_dev, static, pdl=pdl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora_triton(y, x, lora_a, lora_b, ranks_dev, static, pdl=pdl)
    for seed in (1, 2, 3):
        meta = step_meta(seed)
        static.copy_(meta)
        y.zero_()
        graph.replay()
        ref = torch.zeros_like(y)
        add_lora(ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
        assert rel_err(y.float(), ref.float()) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("slots", [8, 32])
@pytest.mark.parametrize("blas, carveout", [("cublas", 0), ("cublaslt", 32)])
@pytest.mark.parametrize("max_chunks", [16, 1 << 30])
@pytest.mark.parametrize("gemm_first", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_lora_on_a_side_stream_beside_the_gemm(captured: bool, slots: int, blas: str, carveout: int,
                                               max_chunks: int, gemm_first: bool, store: bool, monkeypatch) -> None:
    """`linear_lora_deferred` with a side stream (the engine's CUDA path): with few chunks, zero,
    shrink and expand into a delta run beside the base GEMM (which leaves `carveout` SMs free);
    with more than `overlap_max_chunks` (16, or no limit) the LoRA is added after the GEMM (no
    delta). Above `few_chunks` (16) beside the GEMM, the shrink zeroes the delta (no memset); with
    `delta_store` (`store`) nothing zeroes it and the expand stores into it, defined on the rows
    `meta.has_lora` names (some tokens here have no adapter).
    Eager, and captured once then replayed with other steps' metadata: y (+ delta) = x Wᵀ + LoRA,
    against the GEMM plus the torch reference."""
    from lorafleet.kernels.lora import linear as lora_linear

    monkeypatch.setattr(lora_linear, "SIDE_PATH", replace(
        lora_linear.SIDE_PATH, delta_store=(store, store), overlap_max_chunks=max_chunks, carveout=(carveout,) * 4,
        gemm_first=(gemm_first, gemm_first)))  # GEMM or LoRA launched first
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(blas)
    try:
        _side_stream_case(captured, slots, max_chunks)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    assert torch._C._get_sm_carveout_experimental() in (None, 0)  # restored after each GEMM


def _side_stream_case(captured: bool, slots: int, max_chunks: int = 16) -> None:
    tokens, k, d_in, outs = 64, 1, 4096, [4096, 1024, 1024]  # slots 8: max_chunks 12; 32: 36
    ranks = [[16] * slots, [8] * slots, [16 if s % 2 else 0 for s in range(slots)]]
    g = torch.Generator().manual_seed(5)
    lora_a, lora_b = make_weights(g, slots, 16, d_in, outs, ranks, torch.bfloat16, "cuda", "rank_major")
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    w = (torch.randn(sum(outs), d_in, generator=g) / d_in**0.5).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, d_in, generator=g).to("cuda", torch.bfloat16)
    side = torch.cuda.Stream()

    def step_meta(seed: int):
        gg = torch.Generator().manual_seed(seed)
        return build_lora_meta(torch.randint(-1, slots, (tokens, k), generator=gg),
                               torch.rand(tokens, k, generator=gg) + 0.5, slots, "cuda")

    def run(meta):
        y, delta = linear_lora_deferred(lambda: x @ w.T, x, lora_a, lora_b, ranks, ranks_dev, meta, "triton", side)
        assert (delta is not None) == (meta.grid_chunks <= max_chunks)
        if delta is None:
            return y
        return y + torch.where(meta.has_lora[:, None] != 0, delta, torch.zeros((), dtype=delta.dtype, device="cuda"))

    static = step_meta(0)
    assert (static.grid_chunks <= 16) == (slots == 8)  # few chunks with 8 slots, many with 32
    out = run(static)  # compiles outside any capture
    if captured:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(static)
    poison_like_delta = torch.full_like(out, float("nan"))
    for seed in (1, 2, 3):
        meta = step_meta(seed)
        if captured:
            static.copy_(meta)
            graph.replay()
            got = out
        else:
            # Free a NaN block of the delta's size first: the caching allocator hands it to the
            # delta, so rows a storing expand leaves unwritten hold NaN and show if read unmasked.
            del poison_like_delta
            got = run(meta)
            poison_like_delta = torch.full_like(got, float("nan"))
        ref = x @ w.T
        add_lora(ref, x, lora_a, lora_b, ranks, ranks_dev, meta, "torch")
        base = x @ w.T
        assert rel_err(got.float() - base.float(), ref.float() - base.float()) < 1e-2

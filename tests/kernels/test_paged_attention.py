"""Triton paged decode attention against `paged_decode_attention_reference` and the engine's torch path.

Without CUDA the kernel runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on small
shapes in fp32 / fp16. With CUDA the same cases run compiled, plus the `@pytest.mark.gpu` cases: bf16
at the seed model's shape (B=64, H=32, KVH=8, D=128, contexts up to 2k), CUDA-graph replay with new
block tables and context lengths, and the engine with `attention_backend="triton"`.
"""

from __future__ import annotations

import os

import pytest
import torch

from lorafleet.kernels.attention.paged_attention import (
    DecodeConfig,
    paged_decode_attention,
    paged_decode_attention_reference,
    pick_config,
)
from lorafleet.worker.config import ConfigError, EngineConfig
from lorafleet.worker.layers.attention import (
    AttentionMetadata,
    decode_attention,
    paged_attention,
    resolve_attention_backend,
)
from tests.kernels.hopper_compile import run_hopper_compile

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def make_case(
    seed: int,
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    fill: float = float("nan"),
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, ...]:
    """q, caches, block tables and lengths for one decode step.

    Every sequence gets its own blocks in a random order from a shuffled pool, so tables are not
    contiguous. Cache slots past a sequence's context, unused blocks, and the blocks that table
    padding points at hold `fill` (NaN by default): reading any of them shows in the output.
    """
    g = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    per_seq = [-(-n // block_size) for n in context_lens]
    max_blocks = max(max(per_seq), 1) + 1  # one padding column at least
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), fill)
    v_cache = torch.full_like(k_cache, fill)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    unused = pool[sum(per_seq):]  # never written: padding entries point here
    tables = torch.tensor(unused[0], dtype=torch.int32).repeat(batch, max_blocks)
    taken = 0
    for b, n in enumerate(context_lens):
        blocks = pool[taken : taken + per_seq[b]]
        taken += per_seq[b]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for t in range(n):
            k_cache[blocks[t // block_size], t % block_size] = torch.randn(kv_heads, head_dim, generator=g)
            v_cache[blocks[t // block_size], t % block_size] = torch.randn(kv_heads, head_dim, generator=g)
    q = torch.randn(batch, heads, head_dim, generator=g)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), tables.to(device),
            lens.to(device))


def rel_norm_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=1e-2)}

# One block of 16: 1 token, exactly a block, not a multiple of the block, and one ten times longer.
CONTEXTS = [1, 16, 37, 150]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize(
    "config", [DecodeConfig(block_n=16, num_splits=1), DecodeConfig(block_n=32, num_splits=4)], ids=["one", "split"]
)
def test_matches_reference(dtype, head_dim, heads, kv_heads, config) -> None:
    q, kc, vc, tables, lens = make_case(head_dim + heads, CONTEXTS, heads, kv_heads, head_dim, 16, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, kc, vc, tables, lens, scale, config=config)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_block_sizes_and_default_config(block_size: int) -> None:
    """Tiles that span several small blocks, and blocks larger than a tile; the picked launch config."""
    q, kc, vc, tables, lens = make_case(block_size, [3, block_size, block_size + 5, 140], 4, 2, 64, block_size,
                                        torch.float32)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, kc, vc, tables, lens, 0.125),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_head_dim_not_a_power_of_two(num_splits: int) -> None:
    q, kc, vc, tables, lens = make_case(8, [7, 50], 6, 2, 80, 16, torch.float32)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.1, config=DecodeConfig(16, num_splits))
    torch.testing.assert_close(out, paged_decode_attention_reference(q, kc, vc, tables, lens, 0.1),
                               **TOLERANCE[torch.float32])


def test_sharp_softmax_moves_its_max_across_tiles_and_splits() -> None:
    """Large logits whose max sits in a late tile: the online rescaling and the split merge must agree."""
    q, kc, vc, tables, lens = make_case(5, [150, 97], 4, 1, 64, 16, torch.float32)
    kc[tables[0, 8], 5] *= 4.0  # token 133 of sequence 0: tile 4 of 5 (block_n 32)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens, 1.0)
    for config in (DecodeConfig(32, 1), DecodeConfig(32, 2), DecodeConfig(16, 8), DecodeConfig(64, 32)):
        out = paged_decode_attention(q, kc, vc, tables, lens, 1.0, config=config)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_rows_give_zeros(num_splits: int) -> None:
    """Context 0 marks a padding row of a CUDA-graph batch bucket: zeros, not NaN, and no reads."""
    q, kc, vc, tables, lens = make_case(2, [0, 20, 0], 4, 2, 64, 16, torch.float32)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.125, config=DecodeConfig(16, num_splits))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, paged_decode_attention_reference(q, kc, vc, tables, lens, 0.125))


def test_strided_q_and_given_out() -> None:
    """q as the engine may pass it (a view with a batch stride over more heads); out written in place."""
    _q, kc, vc, tables, lens = make_case(4, [9, 33], 4, 2, 64, 16, torch.float32)
    wide = torch.randn(2, 8, 64, device=DEVICE)
    q = wide[:, :4]
    out = torch.full((2, 4, 64), float("nan"), device=DEVICE)
    got = paged_decode_attention(q, kc, vc, tables, lens, 0.125, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, paged_decode_attention_reference(q, kc, vc, tables, lens, 0.125),
                               **TOLERANCE[torch.float32])


def test_rejects_bad_inputs() -> None:
    q, kc, vc, tables, lens = make_case(1, [5, 9], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kc, vc, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kc, vc, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], kc, vc, tables, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.half(), kc, vc, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :32], kc, vc, tables, lens, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, kc, vc, tables, lens, 1.0, config=DecodeConfig(block_n=8, num_splits=1))


def test_pick_config_depends_on_table_width_only() -> None:
    dev = torch.device(DEVICE)
    few = pick_config(1, 1, max_blocks=2, block_size=16, head_dim=128, device=dev)
    assert few.num_splits == 1  # 32 tokens: one tile, nothing to split
    long = pick_config(1, 8, max_blocks=128, block_size=16, head_dim=128, device=dev)
    assert long.num_splits > 1 and long.num_splits & (long.num_splits - 1) == 0
    assert pick_config(64, 8, 128, 16, 128, dev).num_splits <= long.num_splits


# Compiles both kernels for sm_90 (ptxas included) in a fresh interpreter-free process, with the
# divisibility-by-16 hints the JIT derives from real strides and pointers. This catches what the
# interpreter lets through (tl.dot below 16, dtype mixes in dot, ...) without a GPU.
HOPPER_COMPILE = r"""
from lorafleet.kernels.attention import paged_attention as pa

strides = ["stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh",
           "stride_tb", "stride_ob", "stride_oh"]
for dt, group, block_n, splits in [("bf16", 4, 64, 1), ("bf16", 8, 32, 8), ("fp16", 1, 128, 2), ("fp32", 4, 64, 4)]:
    p = "*" + dt
    sig = {"q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
           "out_ptr": p, "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
           "num_heads": "i32", "qk_scale": "fp32", "window": "i32", "cap_in": "fp32", "cap_out": "fp32", **{s: "i32" for s in strides}}
    const = dict(HEAD_DIM=128, D_PAD=128, GROUP=group, G_PAD=max(16, group), BLOCK_SIZE=16, BLOCK_N=block_n,
                 NUM_SPLITS=splits, UPCAST=dt == "fp32", IEEE=dt == "fp32", SOFTCAP=group == 8, PDL=group > 1)
    k = compile_(pa._paged_decode_kernel, sig, const, stages=2)
    assert "ld.global.v4" in k.asm["ptx"], "K/V loads are not vectorised"
    assert ("griddepcontrol.wait" in k.asm["ptx"]) == (group > 1)  # PDL: waits on the device first
    red = {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "out_ptr": p, "num_heads": "i32",
           "stride_ob": "i32", "stride_oh": "i32"}
    k = compile_(pa._reduce_splits_kernel, red, dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=max(2, splits), PDL=group > 1),
                 stages=2)
    assert ("griddepcontrol.wait" in k.asm["ptx"]) == (group > 1)
print("ok")
"""


def test_compiles_for_hopper() -> None:
    """Both kernels compile to sm_90 cubins (no GPU needed); skipped where this Triton lacks the API."""
    run_hopper_compile(HOPPER_COMPILE)


# -- the engine's attention module --------------------------------------------------------------


def decode_meta(tables: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    n = len(lens)
    return AttentionMetadata(
        query_lens=[1] * n,
        context_lens=lens.tolist(),
        query_start=list(range(n + 1)),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=lens.device),  # not read by attention
        block_tables=tables,
        context_lens_t=lens,
        all_decode=True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_worker_torch_path(dtype) -> None:
    """The engine's torch path (gather + SDPA) for an all-decode step is the second oracle."""
    q, kc, vc, tables, lens = make_case(6, [1, 16, 37, 150, 64], 8, 2, 64, 16, dtype, fill=0.5)
    meta = decode_meta(tables, lens)
    torch_out = paged_attention(q, kc, vc, meta, 0.125)
    triton_out = paged_attention(q, kc, vc, meta, 0.125, backend="triton")
    torch.testing.assert_close(triton_out.float(), torch_out.float(), **TOLERANCE[dtype])
    # Without the host's max context the torch path pads to the table width: same result.
    padded = decode_attention(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(padded.float(), torch_out.float(), **TOLERANCE[dtype])


def test_prefill_steps_keep_the_torch_path() -> None:
    """A step with a prefill chunk is not all-decode: the triton switch must not change it."""
    q1, kc, vc, tables, lens = make_case(7, [20, 9], 4, 2, 64, 16, torch.float32, fill=0.0)
    meta = AttentionMetadata(
        query_lens=[4, 1], context_lens=[20, 9], query_start=[0, 4, 5],
        slot_mapping=torch.zeros(5, dtype=torch.int64, device=DEVICE), block_tables=tables,
        context_lens_t=lens, all_decode=False,
    )
    q = torch.randn(5, 4, 64, device=DEVICE)
    assert torch.equal(paged_attention(q, kc, vc, meta, 0.125, backend="triton"), paged_attention(q, kc, vc, meta, 0.125))


def test_backend_switch_is_validated(monkeypatch) -> None:
    assert EngineConfig().attention_backend == "auto"
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="attention_backend"):
        resolve_attention_backend("flash", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="needs --device cuda"):
        resolve_attention_backend("triton", torch.device("cpu"))
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"


def engine_step_logits(demo_model, backend: str, device: str, dtype: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams

    config = EngineConfig(max_loras=2, max_cpu_loras=2, num_kv_blocks=64, device=device, dtype=dtype,
                          attention_backend=backend)
    engine = LLMEngine(demo_model, config)
    assert engine.model.attention_backend == backend
    logits: list[torch.Tensor] = []
    engine.logits_hook = lambda seqs, rows: logits.append(rows.float().cpu().clone())
    # Prompts of very different lengths (1 to ~3 blocks of 16), decoded together for 5 steps.
    prompts = ["a", "Hello there, fleet of adapters", "def add(a, b):\n    return a + b\n" * 2]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs], logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_engine_with_triton_attention_matches_torch(demo_model, device: str) -> None:
    """The whole engine, fp32: same greedy tokens and step logits with either attention backend."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on CPU only in the interpreter")
    tokens_torch, logits_torch = engine_step_logits(demo_model, "torch", device, "float32")
    tokens_triton, logits_triton = engine_step_logits(demo_model, "triton", device, "float32")
    assert tokens_triton == tokens_torch
    assert len(logits_triton) == len(logits_torch)
    for got, ref in zip(logits_triton, logits_torch):
        assert (got - ref).abs().max() / ref.abs().max() <= 1e-4


# -- on the GPU (run on the H200) -------------------------------------------------------------

SEED_SHAPE = dict(heads=32, kv_heads=8, head_dim=128)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", [None, DecodeConfig(64, 1), DecodeConfig(32, 8), DecodeConfig(128, 2)],
                         ids=["picked", "one", "split8", "tile128"])
def test_bf16_seed_shape(config) -> None:
    """bf16 at the seed shape, batch 64, contexts 1..2048: ‖Δ‖/‖ref‖ ≤ 1e-2, max |Δ| ≤ 3e-2.

    The reference works in fp32 from the same bf16 cache; the kernel rounds the probabilities to
    bf16 for the P·V dot (8 mantissa bits, as flash attention does) and the output to bf16:
    expected ~3e-3 relative, outputs are O(0.1..1).
    """
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 2049, (64,), generator=g)
    lens[:4] = torch.tensor([1, 16, 2048, 1000])
    q, kc, vc, tables, lens_t = make_case(1, lens.tolist(), block_size=16, dtype=torch.bfloat16, device="cuda",
                                          fill=0.0, **SEED_SHAPE)
    out = paged_decode_attention(q, kc, vc, tables, lens_t, 128**-0.5, config=config)
    ref = paged_decode_attention_reference(q, kc, vc, tables, lens_t, 128**-0.5)
    assert rel_norm_err(out, ref.float()) <= 1e-2
    assert (out.float() - ref.float()).abs().max() <= 3e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split", [False, True])
def test_cuda_graph_replay_with_new_tables_and_lens(split: bool) -> None:
    """Capture once at a bucket's shapes; replay with other steps' q, block tables and lengths copied in.

    The table width is the graph's (max_model_len / block_size), lengths change freely below it, and
    the last rows are padding (context 0).
    """
    batch, max_len, block_size = 16, 2048, 16
    max_blocks = max_len // block_size
    num_blocks = batch * max_blocks
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(num_blocks, block_size, 8, 128, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn_like(kc)
    static_q = torch.zeros(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    static_tables = torch.zeros(batch, max_blocks, device="cuda", dtype=torch.int32)
    static_lens = torch.zeros(batch, device="cuda", dtype=torch.int32)
    static_out = torch.empty_like(static_q)
    config = DecodeConfig(64, 8 if split else 1)

    def launch() -> None:
        paged_decode_attention(static_q, kc, vc, static_tables, static_lens, 128**-0.5, out=static_out, config=config)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for step in range(4):
        gg = torch.Generator().manual_seed(10 + step)
        lens = torch.randint(1, max_len + 1, (batch,), generator=gg)
        lens[-2:] = 0
        tables = torch.randperm(num_blocks, generator=gg)[: batch * max_blocks].view(batch, max_blocks)
        static_q.copy_(torch.randn(batch, 32, 128, generator=gg))
        static_tables.copy_(tables)
        static_lens.copy_(lens)
        static_out.fill_(float("nan"))
        graph.replay()
        ref = paged_decode_attention_reference(static_q, kc, vc, static_tables, static_lens, 128**-0.5)
        assert torch.equal(static_out[-2:], torch.zeros_like(static_out[-2:]))
        assert rel_norm_err(static_out, ref.float()) <= 1e-2

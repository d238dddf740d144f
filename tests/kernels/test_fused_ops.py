"""Fused elementwise kernels (`kernels/fused_ops.py`) against their torch references and the model.

Without CUDA the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) on
small odd shapes in fp32 / fp16: sizes that are not powers of two, GQA and MHA, a head_dim whose
half is not a power of two, positions up to 100k, padding rows that write the KV sink. The
references are checked against the model's torch path (`worker/models/llama.py`), and the model
itself runs both paths: `LlamaModel.forward` on a tiny random Qwen2 config (prefill, then a decode
step with a padding row), and the demo engine with adapters through the static-buffer path.
With CUDA the same cases run compiled, plus the `@pytest.mark.gpu` cases: bf16 at the seed shape
(hidden 4096, 32 heads, 8 KV heads, head_dim 128, T in 1, 64, 300) and CUDA-graph replay.

Tolerances: fp32 2e-6 relative (one rounding apart); fp16/bf16 one ulp of the dtype, as
torch.testing's defaults (rtol 1e-3 / 1.6e-2): the kernels round where the torch path rounds,
but sum the squares in another order and compute sigmoid and rsqrt their own way.
"""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from lorafleet.kernels.fused_ops import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rope_write_kv,
    rope_write_kv_reference,
    silu_mul,
    silu_mul_reference,
)
from lorafleet.worker.attention import AttentionMetadata, write_kv
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.models import llama
from lorafleet.worker.models.llama import LlamaModel, Rotary
from tests.kernels.hopper_compile import run_hopper_compile

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=2e-6), torch.float16: {}, torch.bfloat16: {}}


def rotary(head_dim: int, max_positions: int, device: str = DEVICE) -> Rotary:
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=4 * head_dim,
                                        intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                                        head_dim=head_dim, rope_theta=500000.0))
    return Rotary(config, max_positions, torch.device(device))


# -- rms_norm, add_rms_norm --------------------------------------------------------------------

NORM_SHAPES = [(1, 8), (5, 37), (3, 300), (2, 1500)]


def norm_case(seed: int, tokens: int, hidden: int, dtype: torch.dtype, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * 3.0
    residual = torch.randn(tokens, hidden, generator=g)
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return x.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


@DTYPES
@pytest.mark.parametrize("tokens, hidden", NORM_SHAPES)
def test_rms_norm_matches_reference(dtype, tokens: int, hidden: int) -> None:
    x, _, weight = norm_case(0, tokens, hidden, dtype)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("tokens, hidden", NORM_SHAPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_add_rms_norm_updates_the_residual_in_place(dtype, tokens: int, hidden: int, with_delta: bool) -> None:
    """With a delta (the LoRA side path's output), x + delta is rounded before the residual add."""
    x, residual, weight = norm_case(1, tokens, hidden, dtype)
    delta = torch.randn_like(x) if with_delta else None
    ref_residual = residual.clone()
    ref = add_rms_norm_reference(x, ref_residual, weight, 1e-6, delta)
    out = add_rms_norm(x, residual, weight, 1e-6, delta)
    assert torch.equal(residual, ref_residual)  # the same rounded adds, element by element
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_norms_read_strided_rows() -> None:
    """Rows of a wider buffer (a row stride past hidden): only `hidden` columns are read or written."""
    wide = torch.randn(4, 50, device=DEVICE)
    residual = torch.randn(4, 60, device=DEVICE)
    weight = torch.rand(37, device=DEVICE)
    x, r = wide[:, :37], residual[:, :37]
    before = residual.clone()
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), **TOLERANCE[torch.float32])
    out = add_rms_norm(x, r, weight, 1e-5)
    assert torch.equal(residual[:, 37:], before[:, 37:])
    torch.testing.assert_close(out, add_rms_norm_reference(x, before[:, :37], weight, 1e-5), **TOLERANCE[torch.float32])


# -- rope_write_kv -------------------------------------------------------------------------------

# (heads, kv_heads, head_dim): GQA 2:1, MHA with odd heads, half = 6 (not a power of two), 5:1.
HEAD_SHAPES = [(4, 2, 16), (3, 3, 8), (6, 2, 12), (5, 1, 64)]
BLOCK_SIZE = 4
NUM_BLOCKS = 6  # + 1: the sink block past them, as `ModelRunner` allocates
SINK = NUM_BLOCKS * BLOCK_SIZE
# Positions from 0 to 100k; the last two rows are padding: position 0, the sink slot.
POSITIONS = [0, 1, 17, 2047, 4096, 65_535, 99_999, 0, 0]
SLOTS = [3, 0, 23, 5, 12, 9, 17, SINK, SINK]


def rope_case(seed: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = DEVICE,
              positions: list[int] = POSITIONS, slots: list[int] = SLOTS):
    """qkv, positions, slots and NaN-filled caches; the padding rows repeat one token, as in a graph bucket
    (same token at position 0), so what lands in the sink does not depend on which row writes last."""
    g = torch.Generator().manual_seed(seed)
    tokens = len(positions)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    pad = [i for i, s in enumerate(slots) if s == SINK]
    if pad:
        qkv[pad] = qkv[pad[0]].clone()
    k_cache = torch.full((NUM_BLOCKS + 1, BLOCK_SIZE, kv_heads, head_dim), float("nan"))
    return (qkv.to(device, dtype), torch.tensor(positions, device=device), k_cache.to(device, dtype),
            k_cache.clone().to(device, dtype), torch.tensor(slots, device=device))


@DTYPES
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_rope_write_kv_matches_reference(dtype, heads: int, kv_heads: int, head_dim: int, with_delta: bool) -> None:
    qkv, positions, k_cache, v_cache, slots = rope_case(2, heads, kv_heads, head_dim, dtype)
    delta = None
    if with_delta:  # the same on padding rows, as their qkv (see rope_case)
        delta = torch.randn_like(qkv)
        delta[-2:] = delta[-2]
    cos_sin = rotary(head_dim, 100_000).cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_q = rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots, delta)
    q = rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, delta)
    assert q.shape == (len(POSITIONS), heads, head_dim) and q.data_ptr() == qkv.data_ptr()  # a view
    torch.testing.assert_close(q, ref_q, **TOLERANCE[dtype])
    torch.testing.assert_close(qkv, ref_qkv, **TOLERANCE[dtype])  # k and v columns untouched
    # Written slots (the sink included) match; every other slot still holds its NaN.
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, **TOLERANCE[dtype])
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    written = k_cache.flatten(0, 1).isnan().flatten(1).any(1).logical_not().nonzero().flatten()
    assert written.tolist() == sorted(set(SLOTS))


def test_rope_write_kv_takes_int32_indices_and_other_cache_dtypes() -> None:
    """int32 positions and slots; an fp16 cache below fp32 activations (cast on the store, as write_kv)."""
    qkv, positions, k_cache, v_cache, slots = rope_case(3, 4, 2, 16, torch.float32)
    cos_sin = rotary(16, 100_000).cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.half(), v_cache.half()
    rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots)
    k_half, v_half = k_cache.half(), v_cache.half()
    rope_write_kv(qkv, positions.int(), cos_sin, k_half, v_half, slots.int())
    torch.testing.assert_close(qkv, ref_qkv, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k_half, ref_k, equal_nan=True)
    torch.testing.assert_close(v_half, ref_v, equal_nan=True)


def test_rope_reference_is_the_model_torch_path() -> None:
    """Rotary.apply + write_kv (in fp32) give what the reference gives; cos_sin holds Rotary's tables."""
    heads, kv_heads, head_dim = 4, 2, 16
    rot = rotary(head_dim, 100_000, "cpu")
    half = head_dim // 2
    assert torch.equal(rot.cos_sin, torch.cat([rot.cos[:, :half], rot.sin[:, :half]], dim=-1))
    qkv, positions, k_cache, v_cache, slots = rope_case(4, heads, kv_heads, head_dim, torch.float32, "cpu")
    cos, sin = rot.at(positions, torch.float32)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q = Rotary.apply(q.reshape(-1, heads, head_dim), cos, sin)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, Rotary.apply(k.reshape(-1, kv_heads, head_dim), cos, sin),
             v.reshape(-1, kv_heads, head_dim), slots)
    got_q = rope_write_kv_reference(qkv, positions, rot.cos_sin, k_cache, v_cache, slots)
    torch.testing.assert_close(got_q, want_q, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k_cache, want_k, equal_nan=True, **TOLERANCE[torch.float32])
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


def test_norm_and_silu_references_are_the_model_torch_path() -> None:
    x, residual, weight = norm_case(5, 3, 37, torch.float16, "cpu")
    assert torch.equal(rms_norm_reference(x, weight, 1e-5), llama.rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(3, 2 * 45, dtype=torch.float16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul_reference(gate_up), F.silu(gate) * up)


def test_rope_write_kv_rejects_bad_inputs() -> None:
    qkv, positions, k_cache, v_cache, slots = rope_case(6, 4, 2, 16, torch.float32)
    cos_sin = rotary(16, 100_000).cos_sin
    with pytest.raises(ValueError, match="qkv must be"):
        rope_write_kv(qkv[:, :-8], positions, cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="positions and slot_mapping"):
        rope_write_kv(qkv, positions[:-1], cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope_write_kv(qkv, positions, cos_sin.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="integer"):
        rope_write_kv(qkv, positions.float(), cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches"):
        rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache[:, :2], slots)


# -- silu_mul ------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("tokens, inter", [(1, 1), (3, 45), (2, 1500)])
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_silu_mul_matches_reference(dtype, tokens: int, inter: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 6.0).to(DEVICE, dtype)  # sigmoid's tails too
    delta = (torch.randn(tokens, 2 * inter, generator=g) * 2.0).to(DEVICE, dtype) if with_delta else None
    out = silu_mul(gate_up, delta)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_mul_reference(gate_up, delta), **TOLERANCE[dtype])


def test_delta_rows_leave_the_other_rows_delta_unread() -> None:
    """A storing LoRA expand defines the delta only on rows of tokens with an adapter: with
    `delta_rows`, each op adds it there and nowhere else (the other rows hold NaN, which would show),
    against the references given the same rows, and against no delta at all on the left-out rows."""
    dtype = torch.float16
    rows = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    off = rows == 0
    tokens = rows.numel()

    def poisoned(like: torch.Tensor) -> torch.Tensor:
        d = torch.randn_like(like)
        d[off] = float("nan")
        return d

    x, residual, weight = norm_case(3, tokens, 300, dtype)
    delta = poisoned(x)
    ref_res, plain_res = residual.clone(), residual.clone()
    ref = add_rms_norm_reference(x, ref_res, weight, 1e-6, delta, rows)
    plain = add_rms_norm(x, plain_res, weight, 1e-6)  # no delta at all
    out = add_rms_norm(x, residual, weight, 1e-6, delta, rows)
    assert not out.isnan().any() and not residual.isnan().any()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    torch.testing.assert_close(residual, ref_res, **TOLERANCE[dtype])
    assert torch.equal(out[off], plain[off]) and not torch.equal(out[~off], plain[~off])

    g = torch.Generator().manual_seed(9)
    gate_up = torch.randn(tokens, 90, generator=g).to(DEVICE, dtype)
    delta = poisoned(gate_up)
    out = silu_mul(gate_up, delta, rows)
    torch.testing.assert_close(out, silu_mul_reference(gate_up, delta, rows), **TOLERANCE[dtype])
    assert torch.equal(out[off], silu_mul(gate_up)[off])

    qkv, positions, k_cache, v_cache, slots = rope_case(4, 4, 2, 16, dtype)
    rows[-2:] = 0  # the two padding rows alike (see rope_case)
    off = rows == 0
    delta = poisoned(qkv)
    cos_sin = rotary(16, 100_000).cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_q = rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots, delta, rows)
    q = rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, delta, rows)
    assert not q.isnan().any()
    torch.testing.assert_close(q, ref_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, **TOLERANCE[dtype])
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))


def test_fused_ops_reject_bad_inputs() -> None:
    x, residual, weight = norm_case(8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, weight.half(), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, residual.half(), weight, 1e-5)
    with pytest.raises(ValueError, match="2·I"):
        silu_mul(torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(x, residual, weight, 1e-5, delta=x[:1])
    with pytest.raises(ValueError, match="delta must be"):
        silu_mul(torch.zeros(2, 8, device=DEVICE), delta=torch.zeros(2, 8, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="delta_rows must be"):
        add_rms_norm(x, residual, weight, 1e-5, x.clone(), torch.ones(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="delta_rows must be"):
        silu_mul(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE), torch.ones(2, device=DEVICE))


# -- the model: both elementwise paths ---------------------------------------------------------


TINY_QWEN2 = dict(model_type="qwen2", vocab_size=61, hidden_size=36, intermediate_size=50, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=12, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0)


def tiny_model(dtype: torch.dtype, backend: str) -> LlamaModel:
    """Random weights (qkv bias included) on an odd Qwen2 shape: hidden 36, 3 heads : 1 KV head of 12."""
    config = ModelConfig.from_dict(TINY_QWEN2)
    g = torch.Generator().manual_seed(11)

    def rnd(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return mean + 0.3 * torch.randn(*shape, generator=g)

    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    named = {"model.embed_tokens.weight": rnd(config.vocab_size, h), "model.norm.weight": rnd(h, mean=1.0),
             "lm_head.weight": rnd(config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for name, out in (("q", config.num_heads * d), ("k", config.num_kv_heads * d), ("v", config.num_kv_heads * d)):
            named[p + f"self_attn.{name}_proj.weight"] = rnd(out, h)
            named[p + f"self_attn.{name}_proj.bias"] = rnd(out)
        named[p + "self_attn.o_proj.weight"] = rnd(h, config.q_size)
        named[p + "mlp.gate_proj.weight"] = rnd(i, h)
        named[p + "mlp.up_proj.weight"] = rnd(i, h)
        named[p + "mlp.down_proj.weight"] = rnd(h, i)
        named[p + "input_layernorm.weight"] = rnd(h, mean=1.0)
        named[p + "post_attention_layernorm.weight"] = rnd(h, mean=1.0)
    model = LlamaModel(config, torch.device(DEVICE), dtype, max_positions=config.max_position_embeddings)
    model.load_weights(named.items())
    model.attention_backend = backend
    return model


def two_steps(model: LlamaModel) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """A prefill of two sequences (5 and 3 tokens), then a decode step of both plus a padding row
    (token 0, position 0, context 0, the sink slot) on fixed shapes, as a graph bucket runs it."""
    c = model.config
    shape = (NUM_BLOCKS + 1, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    caches = [(torch.zeros(shape, dtype=model.dtype, device=DEVICE), torch.zeros(shape, dtype=model.dtype, device=DEVICE))
              for _ in range(c.num_layers)]
    tables = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32, device=DEVICE)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=DEVICE)

    prefill = AttentionMetadata(query_lens=[5, 3], context_lens=[5, 3], query_start=[0, 5, 8],
                                slot_mapping=t([8, 9, 10, 11, 0, 12, 13, 14]), block_tables=tables,
                                context_lens_t=t([5, 3]).int(), all_decode=False)
    logits = [model.forward(t([7, 3, 11, 59, 2, 40, 1, 33]), t([0, 1, 2, 3, 4, 0, 1, 2]), prefill, caches, None,
                            t([4, 7]))]
    decode = AttentionMetadata(query_lens=[1] * 3, context_lens=[0] * 3, query_start=[0, 1, 2, 3],
                               slot_mapping=t([1, 15, SINK]), block_tables=torch.cat([tables, tables[:1] * 0]),
                               context_lens_t=t([6, 4, 0]).int(), all_decode=True, fixed_shapes=True)
    logits.append(model.forward(t([5, 17, 0]), t([5, 3, 0]), decode, caches, None, t([0, 1, 2]), graph=True)[:2])
    return logits, caches


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"])
def test_model_forward_fused_matches_torch_path(dtype, tolerance: float) -> None:
    """LlamaModel.forward with the Triton elementwise path: same logits and K/V as the torch path."""
    want, want_caches = two_steps(tiny_model(dtype, "torch"))
    got, got_caches = two_steps(tiny_model(dtype, "triton"))
    for step, (g, w) in enumerate(zip(got, want)):
        err = float((g - w).abs().max() / w.abs().max())
        assert err <= tolerance, f"step {step}: {err:.2e}"
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):  # every block but the sink
        torch.testing.assert_close(gk[:NUM_BLOCKS], wk[:NUM_BLOCKS], atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(gv[:NUM_BLOCKS], wv[:NUM_BLOCKS], atol=tolerance, rtol=tolerance)


def engine_logits(demo_model, demo_adapters, backend: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    from lorafleet.worker.engine import LLMEngine
    from lorafleet.worker.sequence import SamplingParams

    config = EngineConfig(max_loras=2, max_cpu_loras=4, num_kv_blocks=64, dtype="float32", lora_backend="torch",
                          attention_backend=backend, cuda_graphs=True)
    modules = {name: str(demo_adapters[name]) for name in ("sql", "chat")}
    engine = LLMEngine(demo_model, config, lora_modules=modules)
    logits: list[torch.Tensor] = []
    engine.logits_hook = lambda seqs, rows: logits.append(rows.float().cpu().clone())
    prompts = ["Hello there, fleet of adapters", "SELECT name FROM students", "Roses are red"]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, sp, [(), (("sql", 1.0),), (("chat", 0.5), ("sql", 0.5))])
    assert engine.runner.graphs is not None and engine.runner.graphs.stats.replays > 0
    return [o.token_ids for o in outs], logits


def test_engine_with_fused_ops_matches_torch_path(demo_model, demo_adapters) -> None:
    """The demo engine on CPU, fp32, with adapters, decoding through the padded static buffers (3
    sequences in a bucket of 4: one padding row writing the sink) with either elementwise path.
    (On CUDA, graphs need the triton backends: test_paged_attention's engine test compares there.)"""
    if HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CPU test: the kernels run in the interpreter")
    tokens_torch, logits_torch = engine_logits(demo_model, demo_adapters, "torch")
    tokens_fused, logits_fused = engine_logits(demo_model, demo_adapters, "triton")
    assert tokens_fused == tokens_torch
    assert len(logits_fused) == len(logits_torch)
    for got, ref in zip(logits_fused, logits_torch):
        assert (got - ref).abs().max() / ref.abs().max() <= 1e-5


# Compiles the kernels for sm_90 (ptxas included) in a fresh interpreter-free process, with the
# divisibility-by-16 hints the JIT derives from real sizes, strides and pointers: what the interpreter lets
# through (dtype mixes, unsupported ops) fails here without a GPU.
HOPPER_COMPILE = r"""
from lorafleet.kernels import fused_ops as ops

SIZES = ("hidden", "inter")  # 4096 and 14336 at the seed shape

for dt in ("bf16", "fp16", "fp32"):
    p = "*" + dt
    norm = {"x_ptr": p, "residual_ptr": p, "weight_ptr": p, "out_ptr": p, "delta_ptr": p, "rows_ptr": "*i32",
            "hidden": "i32",
            "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_d": "i32"}
    rope = {"qkv_ptr": p, "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64",
            "k_cache_ptr": p, "v_cache_ptr": p, "delta_ptr": p, "rows_ptr": "*i32", "num_heads": "i32",
            "num_kv_heads": "i32",
            **{s: "i32" for s in ("stride_qkv", "stride_d", "stride_cs", "stride_kb", "stride_ks", "stride_kh",
                                  "stride_vb", "stride_vs", "stride_vh")}}
    silu = {"gate_up_ptr": p, "out_ptr": p, "delta_ptr": p, "rows_ptr": "*i32", "inter": "i32", "stride_in": "i32",
            "stride_out": "i32", "stride_d": "i32"}
    # Without the LoRA delta of the side stream, with it, and with it defined on some rows only;
    # launched plainly or with PDL (kernels/pdl.py: then they wait on the device first).
    for delta, rows, pdl in ((False, False, False), (True, False, True), (True, True, False), (False, False, True)):
        for add in (False, True):
            k = compile_(ops._rms_norm_kernel, norm,
                         dict(BLOCK=4096, ADD_RESIDUAL=add, HAS_DELTA=delta, HAS_ROWS=rows, PDL=pdl), divisible=SIZES)
            assert "ld.global.v4" in k.asm["ptx"], "rms_norm loads are not vectorised"
            assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
        k = compile_(ops._rope_write_kv_kernel, rope,
                     dict(HALF=64, HALF_PAD=64, H_PAD=32, KVH_PAD=8, BLOCK_SIZE=16, HAS_DELTA=delta, HAS_ROWS=rows,
                          PDL=pdl), divisible=SIZES)
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
        k = compile_(ops._silu_mul_kernel, silu, dict(BLOCK=1024, HAS_DELTA=delta, HAS_ROWS=rows, PDL=pdl),
                     divisible=SIZES)
        assert "ld.global.v4" in k.asm["ptx"], "silu_mul loads are not vectorised"
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
print("ok")
"""


def test_compiles_for_hopper() -> None:
    """Every kernel compiles to sm_90 cubins (no GPU needed); skipped where this Triton lacks the API."""
    run_hopper_compile(HOPPER_COMPILE)


# -- on the GPU (run on the H200) -------------------------------------------------------------

SEED = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_bf16_seed_shape(tokens: int) -> None:
    """bf16 at the seed shape: each op within a bf16 ulp of its reference, the residual add exact."""
    dtype = torch.bfloat16
    x, residual, weight = norm_case(20, tokens, SEED["hidden"], dtype, "cuda")
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    ref_residual = residual.clone()
    ref = add_rms_norm_reference(x, ref_residual, weight, 1e-5)
    torch.testing.assert_close(add_rms_norm(x, residual, weight, 1e-5), ref)
    assert torch.equal(residual, ref_residual)

    gate_up = torch.randn(tokens, 2 * SEED["inter"], device="cuda", dtype=dtype) * 4.0
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up))

    heads, kv_heads, head_dim = SEED["heads"], SEED["kv_heads"], SEED["head_dim"]
    g = torch.Generator().manual_seed(21)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to("cuda", dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g).cuda()
    num_blocks = 2 * tokens
    slots = (torch.randperm(num_blocks * 16, generator=g)[:tokens]).cuda()  # distinct slots
    k_cache = torch.zeros(num_blocks, 16, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cos_sin = rotary(head_dim, 4096, "cuda").cos_sin
    ref_qkv, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_write_kv_reference(ref_qkv, positions, cos_sin, ref_k, ref_v, slots)
    rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots)
    torch.testing.assert_close(qkv, ref_qkv)
    torch.testing.assert_close(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay_with_new_positions_and_slots() -> None:
    """The three ops captured once; replays with new inputs, positions and slots copied in, the
    last rows padding (position 0, the sink slot)."""
    dtype, tokens = torch.bfloat16, 64
    heads, kv_heads, head_dim, hidden = SEED["heads"], SEED["kv_heads"], SEED["head_dim"], SEED["hidden"]
    num_blocks = 64
    sink = num_blocks * 16
    k_cache = torch.zeros(num_blocks + 1, 16, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cos_sin = rotary(head_dim, 4096, "cuda").cos_sin
    weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    static_qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    static_x = torch.zeros(tokens, hidden, device="cuda", dtype=dtype)
    static_h = torch.zeros_like(static_x)
    static_gate_up = torch.zeros(tokens, 2 * SEED["inter"], device="cuda", dtype=dtype)
    static_positions = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    static_slots = torch.full((tokens,), sink, dtype=torch.int64, device="cuda")

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        rope_write_kv(static_qkv, static_positions, cos_sin, k_cache, v_cache, static_slots)
        return add_rms_norm(static_x, static_h, weight, 1e-5), silu_mul(static_gate_up)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, act = launch()
    for step in range(3):
        g = torch.Generator().manual_seed(30 + step)
        qkv = torch.randn(static_qkv.shape, generator=g).to("cuda", dtype)
        qkv[-2:] = qkv[-2]  # padding rows: one token, the same K/V into the sink
        positions = torch.randint(0, 4096, (tokens,), generator=g)
        positions[-2:] = 0
        slots = torch.randperm(sink, generator=g)[:tokens]
        slots[-2:] = sink
        h = torch.randn(tokens, hidden, generator=g).to("cuda", dtype)
        x = torch.randn(tokens, hidden, generator=g).to("cuda", dtype)
        gate_up = torch.randn(static_gate_up.shape, generator=g).to("cuda", dtype)
        for dst, src in ((static_qkv, qkv), (static_positions, positions), (static_slots, slots), (static_h, h),
                         (static_x, x), (static_gate_up, gate_up)):
            dst.copy_(src)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        ref_qkv = qkv.clone()
        rope_write_kv_reference(ref_qkv, positions.cuda(), cos_sin, ref_k, ref_v, slots.cuda())
        graph.replay()
        torch.testing.assert_close(static_qkv, ref_qkv)
        torch.testing.assert_close(k_cache, ref_k)
        assert torch.equal(v_cache, ref_v)
        torch.testing.assert_close(normed, add_rms_norm_reference(x, h.clone(), weight, 1e-5))
        torch.testing.assert_close(act, silu_mul_reference(gate_up))

"""The fused row kernels together: `LlamaModel.forward` and the demo engine with the Triton
elementwise path (`worker/models/llama.py`) against the torch path, and the three ops captured in
one CUDA graph.

Without CUDA the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1): the
model on a tiny random Qwen2 config (prefill, then a decode step with a padding row), and the demo
engine with adapters through the static-buffer path. With CUDA the model runs compiled, plus the
`@pytest.mark.gpu` CUDA-graph replay at the seed shape.
"""

from __future__ import annotations

import os

import pytest
import torch

from lorafleet.kernels.layers.rms_norm import add_rms_norm, add_rms_norm_reference
from lorafleet.kernels.layers.rope_kv import rope_write_kv, rope_write_kv_reference
from lorafleet.kernels.layers.silu_mul import silu_mul, silu_mul_reference
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.layers.attention import AttentionMetadata
from lorafleet.worker.models.llama import LlamaModel
from tests.kernels.fused_cases import BLOCK_SIZE, DEVICE, HAS_CUDA, NUM_BLOCKS, SEED, SINK, gpu, rotary

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
    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams

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


def test_engine_with_fused_kernels_matches_torch_path(demo_model, demo_adapters) -> None:
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


# -- on the GPU (run on the H200) -------------------------------------------------------------


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

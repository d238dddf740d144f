"""DoRA adapters served by the engine in one batch with plain-LoRA adapters and the base model,
against transformers + PEFT (fp32 tiny checkpoints): Llama, Qwen2 (q/k/v biases, which DoRA leaves
unscaled) and Phi-3 (fused qkv_proj / gate_up_proj, whose norms are the fused module's rows).
First-step top-5 logprobs equal PEFT's to 2e-3 and greedy continuations for 16 tokens; the torch
path, and the Triton LoRA, epilogue and graph path in the interpreter. Loading checks: a magnitude
without use_dora, use_dora without magnitudes, a magnitude of the wrong size; a DoRA adapter beside
another in one request, or at a scale, is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine, RequestError
from lorafleet.worker.lora.adapter import AdapterError

pytest.importorskip("transformers")
pytest.importorskip("peft")

from .dora_checkpoints import build_dora, check_mixed_batch  # noqa: E402
from .family_checkpoints import build  # noqa: E402

PROMPT = [5 + (7 * i) % 400 for i in range(40)]
KINDS = ["llama3_rope", "qwen2_tied", "phi3_longrope"]


def engine_for(folder, **config) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(max_loras=3, dtype="float32", block_size=8, **config),
                     lora_modules={"a": str(folder / "adapter"), "d": str(folder / "dora")})


@pytest.mark.parametrize("kind", KINDS)
def test_dora_in_a_mixed_batch_matches_peft(kind, tmp_path, demo_model):
    folder = tmp_path / kind
    lora = build(kind, folder, demo_model)
    dora = build_dora(kind, folder)
    engine = engine_for(folder, max_num_batched_tokens=32)
    assert engine.registry.is_dora("d") and not engine.registry.is_dora("a")
    worst = check_mixed_batch(engine, {"": lora, "a": lora, "d": dora}, PROMPT)
    print(f"{kind}: max |Δ logprob| {worst}")


@pytest.mark.parametrize("kind", ["llama3_rope", "qwen2_tied"])
def test_dora_on_the_triton_and_graph_path(kind, tmp_path, demo_model):
    """The Triton LoRA kernels, the DoRA epilogue kernel and the CUDA-graph decode path (on CPU:
    its padded static buffers without capture), against the same oracle."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU only in the interpreter")
    folder = tmp_path / kind
    lora = build(kind, folder, demo_model)
    dora = build_dora(kind, folder)
    engine = engine_for(folder, attention_backend="triton", lora_backend="triton", cuda_graphs=True)
    assert engine.runner.graphs is not None
    worst = check_mixed_batch(engine, {"": lora, "a": lora, "d": dora}, PROMPT)
    print(f"{kind} (triton, graph path): max |Δ logprob| {worst}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_dora_on_cuda(kind, tmp_path, demo_model):
    """The engine's CUDA defaults (Triton LoRA with its side path, the epilogue kernel, fused row
    kernels, CUDA graphs), fp32, against the CPU oracle."""
    folder = tmp_path / kind
    lora = build(kind, folder, demo_model)
    dora = build_dora(kind, folder)
    engine = engine_for(folder, device="cuda", max_num_seqs=4, num_kv_blocks=64)
    assert engine.model.lora_backend == "triton" and engine.runner.graphs is not None
    worst = check_mixed_batch(engine, {"": lora, "a": lora, "d": dora}, PROMPT)
    print(f"{kind} (cuda): max |Δ logprob| {worst}")


def test_dora_alone_or_refused_in_a_request(tmp_path, demo_model):
    folder = tmp_path / "llama"
    build("llama3_rope", folder, demo_model)
    build_dora("llama3_rope", folder)
    engine = engine_for(folder, max_loras_per_request=2)
    with pytest.raises(RequestError, match="one adapter"):
        engine.add_request(PROMPT, adapters=(("a", 1.0), ("d", 1.0)))
    with pytest.raises(RequestError, match="scale 1.0"):
        engine.add_request(PROMPT, adapters=(("d", 0.5),))
    engine.add_request(PROMPT, adapters=(("d", 1.0),))
    engine.add_request(PROMPT, adapters=(("a", 0.5), ("a", 0.5)))  # plain LoRA: merged, at any scale


def _rewrite(folder, config_edit=None, drop=None, reshape=None):
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    if config_edit:
        cfg.update(config_edit)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    for k in list(tensors):
        if drop and drop in k:
            del tensors[k]
        elif reshape and reshape in k:
            tensors[k] = tensors[k][:-1].contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("edit,reason,match", [
    (dict(config_edit={"use_dora": False}), "bad_tensor", "use_dora"),
    (dict(drop="layers.1.mlp.down_proj.lora_magnitude_vector"), "bad_weights", "lora_magnitude_vector"),
    (dict(reshape="layers.0.self_attn.q_proj.lora_magnitude_vector"), "shape_mismatch", "lora_magnitude_vector"),
    (dict(config_edit={"use_dora": "yes"}), "bad_config", "use_dora"),
])
def test_bad_dora_adapters_are_refused(edit, reason, match, tmp_path, demo_model):
    folder = tmp_path / "llama"
    build("llama3_rope", folder, demo_model)
    build_dora("llama3_rope", folder)
    _rewrite(folder / "dora", **edit)
    engine = LLMEngine(folder, EngineConfig(max_loras=2, dtype="float32", block_size=8))
    with pytest.raises(AdapterError, match=match) as err:
        engine.load_adapter("d", str(folder / "dora"))
    assert err.value.reason == reason


def test_one_slot_turns_dora_and_back(tmp_path, demo_model):
    """One GPU slot, taken in turn by the DoRA adapter, the LoRA one and the DoRA one again: the
    slot's DoRA flag follows its adapter (a LoRA adapter in a slot a DoRA one left is not rescaled)."""
    folder = tmp_path / "qwen2"
    lora = build("qwen2_tied", folder, demo_model)
    dora = build_dora("qwen2_tied", folder)
    engine = LLMEngine(folder, EngineConfig(max_loras=1, dtype="float32", block_size=8),
                       lora_modules={"a": str(folder / "adapter"), "d": str(folder / "dora")})
    for name, model in (("d", dora), ("a", lora), ("d", dora)):
        check_mixed_batch(engine, {"": lora, name: model}, PROMPT)
        # the host flag picks eager steps' launches, the device one the rows a graph's launch rewrites
        assert engine.slots.slot_dora == [name == "d"] and engine.slots.is_dora.tolist() == [int(name == "d")]


# -- the norms, without W + s·BA ----------------------------------------------------------------


def _module(out: int, in_: int, rank: int, seed: int, w_dtype: torch.dtype):
    from lorafleet.worker.lora.weights import ModuleWeights

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, in_, generator=g) * 0.02).to(w_dtype)
    m = ModuleWeights(a=torch.randn(rank, in_, generator=g) * 0.05, b=torch.randn(out, rank, generator=g) * 0.05,
                      scaling=2.0, magnitude=torch.ones(out))
    return m, w


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_norms_without_forming_the_adapted_weight(w_dtype):
    """The expanded ||W_o||² + 2s B_o·(W Aᵀ)_o + s² B_o (A Aᵀ) B_oᵀ equals ||W + s·BA||² per row (in
    float64) to float32 accuracy, with a cached or a fresh ||W_o||², and sums over a split of the input
    columns (a row-parallel shard's part)."""
    from lorafleet.worker.lora.dora import adapted_row_norms_sq
    from lorafleet.worker.lora.weights import ModuleWeights

    m, w = _module(96, 200, 8, 3, w_dtype)
    want = (w.double() + m.scaling * (m.b.double() @ m.a.double())).pow(2).sum(dim=1)
    got = adapted_row_norms_sq(m, w)
    assert got.dtype == torch.float32 and got.shape == (96,)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
    torch.testing.assert_close(adapted_row_norms_sq(m, w, w.float().pow(2).sum(dim=1)), got, rtol=1e-6, atol=0)
    parts = [adapted_row_norms_sq(ModuleWeights(a=m.a[:, cols], b=m.b, scaling=m.scaling), w[:, cols])
             for cols in (slice(0, 77), slice(77, 200))]
    torch.testing.assert_close((parts[0] + parts[1]).double(), want, rtol=2e-6, atol=0)


def test_base_norms_are_kept_per_base_weight_view():
    """||W_o||² is computed once per view of a kept weight (its place in it: another slice is
    another entry), goes when that weight is freed, and is never kept for a weight that is no view."""
    import gc

    from lorafleet.worker.lora.dora import BaseNormCache

    cache = BaseNormCache()
    fused = torch.randn(10, 6)
    first = cache.row_norms_sq(fused[0:4])
    assert cache.row_norms_sq(fused[0:4]) is first  # a fresh view of the same rows: kept
    second = cache.row_norms_sq(fused[4:10])
    torch.testing.assert_close(second, fused[4:10].pow(2).sum(dim=1))
    torch.testing.assert_close(first, fused[0:4].pow(2).sum(dim=1))
    alone = torch.randn(4, 6)
    assert cache.row_norms_sq(alone) is not cache.row_norms_sq(alone)
    assert len(cache._by_base) == 1
    del fused
    gc.collect()
    assert not cache._by_base

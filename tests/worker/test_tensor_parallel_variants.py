"""Tensor parallelism with FP8 weights and with every model family, on CPU over gloo, against the same
engine at TP = 1: FP8 quantized at load (`--quantization fp8`: a row-parallel rank's rows must take
the whole row's scale) and FP8 checkpoints (per-channel scales cut with their rows, per-tensor ones
replicated; at 4 ranks the KV heads are replicated, their scales with them); Qwen3 (q/k norms per
head), Gemma 2 (scaled embedding, soft-capped scores and logits, sliding windows), Gemma 3 (q/k
norms, local RoPE) and Phi-3 (q/k/v and gate/up fused in the checkpoint: cut part by part). Each
batch mixes base, LoRA at two scales and DoRA requests; greedy tokens must be equal and the first
step's logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels.quant.fp8_linear import FP8
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from tests.worker.dora_checkpoints import build_dora
from tests.worker.family_checkpoints import build
from tests.worker.lora_harness import write_adapter
from tests.worker.test_quant import ct, fp8_checkpoint
from tests.worker.test_tensor_parallel import _model, assert_same_outputs, run_sharded

REQUESTS = [(), (("lora", 1.0),), (("dora", 1.0),), (("lora", 0.5),)]


def _config(tp: int, quantization: str | None = None) -> EngineConfig:
    return EngineConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=16, max_loras_per_request=1, device="cpu",
                        dtype="float32", num_kv_blocks=64, block_size=8, warmup=False, tensor_parallel_size=tp,
                        quantization=quantization)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 20, 10, 15)]


def _generate(engine: LLMEngine, prompts):
    return engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=1),
                           REQUESTS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from lorafleet.worker.demo_assets import build_tokenizer

    root = tmp_path_factory.mktemp("tp-fp8")
    model_dir = root / "model"
    model_dir.mkdir()
    vocab = build_tokenizer(model_dir, 256)
    _model(model_dir, vocab)
    config = ModelConfig.from_folder(model_dir)
    build_dora("llama3_rope", model_dir)
    adapters = {"lora": str(write_adapter(root / "lora", config, torch.float32, r=8, alpha=16.0, seed=4)),
                "dora": str(model_dir / "dora")}
    return root, model_dir, adapters, _prompts(vocab)


def test_fp8_quantized_at_load_matches_tp1(llama):
    _, model_dir, adapters, prompts = llama
    single = LLMEngine(model_dir, _config(1, "fp8"), lora_modules=adapters)
    want, w1 = _generate(single, prompts), single.model.weights
    c = single.model_config

    def check(engine: LLMEngine):
        assert engine.quantization == "fp8"
        w = engine.model.weights
        for key in ("o", "down"):  # row-parallel: the whole rows' scales, the e4m3 values of rank 0's columns
            full = w1[f"layers.1.{key}"]
            assert w[f"layers.1.{key}"].dtype == FP8
            assert torch.equal(w[f"layers.1.{key}_scale"], w1[f"layers.1.{key}_scale"])
            assert torch.equal(w[f"layers.1.{key}"].view(torch.uint8), full[:, : full.shape[1] // 2].view(torch.uint8))
        half = c.intermediate_size // 2  # column-parallel: rank 0's rows of gate and of up, as quantized whole
        rows = torch.cat([torch.arange(half), c.intermediate_size + torch.arange(half)])
        assert torch.equal(w["layers.1.gate_up_scale"], w1["layers.1.gate_up_scale"][rows])
        return _generate(engine, prompts)

    assert_same_outputs(want, run_sharded(model_dir, _config(2, "fp8"), adapters, check))


@pytest.mark.parametrize("tp, per, scale_name, qc", [
    (4, "channel", "weight_scale", ct("channel")),
    (2, "tensor", "weight_scale", {"quant_method": "fp8", "activation_scheme": "static"}),
], ids=["ct-channel-tp4", "autofp8-tensor-tp2"])
def test_fp8_checkpoints_match_tp1(llama, tmp_path, tp, per, scale_name, qc):
    _, model_dir, adapters, prompts = llama
    fp8, _ = fp8_checkpoint(model_dir, tmp_path, per, scale_name, qc)
    want = _generate(LLMEngine(fp8, _config(1), lora_modules=adapters), prompts)
    got = run_sharded(fp8, _config(tp), adapters, lambda engine: (engine.quantization, _generate(engine, prompts)))
    assert got[0] == "fp8"
    assert_same_outputs(want, got[1])


@pytest.mark.parametrize("kind, tp", [("qwen3", 2), ("gemma2", 2), ("gemma3_text", 2), ("phi3_longrope", 4)])
def test_families_match_tp1(demo_model, tmp_path, kind, tp):
    folder = tmp_path / kind
    build(kind, folder, demo_model)
    build_dora(kind, folder)
    adapters = {"lora": str(folder / "adapter"), "dora": str(folder / "dora")}
    prompts = _prompts(ModelConfig.from_folder(folder).vocab_size)
    want = _generate(LLMEngine(folder, _config(1), lora_modules=adapters), prompts)
    assert_same_outputs(want, run_sharded(folder, _config(tp), adapters, lambda engine: _generate(engine, prompts)))
    assert len({tuple(o.token_ids) for o in want}) > 2  # the adapters matter


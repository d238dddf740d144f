"""Every served family (Llama with llama3 RoPE, Mistral with a sliding window, Qwen2 tied, Qwen3,
Gemma 2, Gemma 3 text, Phi-3 with longrope) against transformers + PEFT: a tiny random fp32
checkpoint and an adapter on the family's own modules, served by the engine in one batch with the
base model. First-step top-5 logprobs equal the oracle's to 2e-3 (all steps' whole vocabulary is
checked too) and greedy continuations are equal for 16 tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lorafleet.worker.config import ARCHITECTURES, ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.models.registry import MODEL_CLASSES

pytest.importorskip("transformers")
pytest.importorskip("peft")

from .family_checkpoints import FAMILIES, WINDOW, build, oracle_logprobs, soft_capping_bites  # noqa: E402

TOLERANCE = 2e-3  # |engine - oracle| logprob
STEPS = 16
PROMPT = [5 + (7 * i) % 400 for i in range(40)]  # 40 tokens: 5 windows of 8


def check_against_oracle(engine: LLMEngine, peft_model, prompt: list[int]) -> float:
    """Serve the base and the adapter ("a") in one batch -> max |Δ logprob| over every step."""
    rows: dict[int, list[torch.Tensor]] = {}
    engine.logits_hook = lambda seqs, logits: [rows.setdefault(s.seq_id, []).append(r.clone()) for s, r in
                                               zip(seqs, logits)]
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = engine.generate([prompt, prompt], sp, [(), (("a", 1.0),)])
    worst = 0.0
    for rid, (out, with_adapter) in zip(sorted(rows), zip(outs, (False, True))):
        want = oracle_logprobs(peft_model, prompt + out.token_ids[:-1], with_adapter)[len(prompt) - 1 :]
        got = torch.log_softmax(torch.stack(rows[rid]).double(), dim=-1)
        assert got.shape == want.shape == (STEPS, want.shape[1])
        worst = max(worst, float((got - want).abs().max()))
        # The first step's top 5 as the API returns them: the oracle's tokens and logprobs.
        top = out.logprobs[0].top
        want_top = want[0].topk(5)
        assert [t for t, _ in top] == want_top.indices.tolist(), f"adapter={with_adapter}: top-5 tokens differ"
        assert max(abs(v - w) for (_, v), w in zip(top, want_top.values.tolist())) <= TOLERANCE
        # Greedy: every token is the oracle's argmax given the same prefix.
        assert out.token_ids == want.argmax(-1).tolist(), f"adapter={with_adapter}: greedy continuation differs"
    assert worst <= TOLERANCE, f"max |Δ logprob| {worst:.2e}"
    return worst


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_family_matches_transformers(kind, tmp_path, demo_model):
    folder = tmp_path / kind
    peft_model = build(kind, folder, demo_model, shard=kind == "llama3_rope")
    config = ModelConfig.from_folder(folder)
    assert config.model_type == ARCHITECTURES[FAMILIES[kind].architecture]
    engine = LLMEngine(folder, EngineConfig(max_loras=2, dtype="float32", max_num_batched_tokens=32, block_size=8),
                       lora_modules={"a": str(folder / "adapter")})
    # Windows shorter than the prompt, so they change the answer (the test would fail without them).
    if config.sliding_window is not None:
        assert config.sliding_window < len(PROMPT) and any(config.window(i) for i in range(config.num_layers))
    worst = check_against_oracle(engine, peft_model, PROMPT)
    print(f"{kind}: max |Δ logprob| {worst:.2e}")


# Every family's fused elementwise path and the kernel's per-layer windows and caps: Gemma 2's own
# fused layer, Gemma 3's per-layer RoPE tables and q/k norms, Phi-3's longrope tables, Qwen3's q/k norms.
@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text", "phi3_longrope", "qwen3"])
def test_family_on_the_triton_attention_and_graph_path(kind, tmp_path, demo_model):
    """The Triton paged kernel (windows, soft-capping) and the CUDA-graph decode path (on CPU: its
    padded static buffers without capture), checked against the same oracle."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only in the interpreter")
    folder = tmp_path / kind
    peft_model = build(kind, folder, demo_model)
    engine = LLMEngine(folder, EngineConfig(max_loras=2, dtype="float32", block_size=8, attention_backend="triton",
                                            cuda_graphs=True), lora_modules={"a": str(folder / "adapter")})
    assert engine.runner.graphs is not None
    worst = check_against_oracle(engine, peft_model, PROMPT)
    print(f"{kind} (triton attention, graph path): max |Δ logprob| {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_family_on_cuda(kind, tmp_path, demo_model):
    """The engine's CUDA defaults (Triton LoRA and attention, fused row kernels, CUDA graphs, async
    scheduling), fp32, against the CPU oracle."""
    folder = tmp_path / kind
    peft_model = build(kind, folder, demo_model)
    engine = LLMEngine(folder, EngineConfig(max_loras=2, dtype="float32", block_size=8, device="cuda", max_num_seqs=4),
                       lora_modules={"a": str(folder / "adapter")})
    assert engine.model.attention_backend == "triton" and engine.runner.graphs is not None
    worst = check_against_oracle(engine, peft_model, PROMPT)
    print(f"{kind} (cuda): max |Δ logprob| {worst:.2e}")


def test_gemma2_soft_capping_bites(tmp_path, demo_model):
    peft_model = build("gemma2", tmp_path / "g", demo_model)
    assert soft_capping_bites(peft_model, PROMPT) > 0.05


def test_prefix_caching_stays_exact_under_windows(tmp_path, demo_model):
    """A prompt whose first blocks come from the prefix cache (written by an earlier request) is
    answered as transformers answers it, in every windowed family's layers."""
    folder = tmp_path / "gemma2"
    peft_model = build("gemma2", folder, demo_model)
    engine = LLMEngine(folder, EngineConfig(max_loras=2, dtype="float32", block_size=8, enable_prefix_caching=True),
                       lora_modules={"a": str(folder / "adapter")})
    engine.generate([PROMPT[:32]], SamplingParams(max_tokens=1, temperature=0.0))
    hits = engine.blocks.prefix_hits
    check_against_oracle(engine, peft_model, PROMPT)
    assert engine.blocks.prefix_hits - hits >= 3 * WINDOW, "the second prompt should reuse cached blocks"


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    raw = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_folder(tmp_path)
    for arch in ARCHITECTURES:
        assert arch in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM"):
        ModelConfig.from_folder(tmp_path)


def test_every_family_has_a_model_class():
    assert set(MODEL_CLASSES) == set(ARCHITECTURES.values())


def test_phi3_adapter_on_unfused_names_is_refused(tmp_path, demo_model):
    """Phi-3's modules are fused: an adapter naming q_proj cannot be for it."""
    from lorafleet.worker.lora.adapter import AdapterError, parse_adapter_config

    model = ModelConfig.from_dict({**{"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
                                   "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                                   "num_hidden_layers": 2, "num_attention_heads": 4})
    raw = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}).encode()
    with pytest.raises(AdapterError, match="qkv_proj"):
        parse_adapter_config(raw, model, 64)

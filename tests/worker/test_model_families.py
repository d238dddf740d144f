"""Llama, Mistral and Qwen2 checkpoints (GQA, llama3 RoPE scaling, qkv bias, tied embeddings,
sharded safetensors) against transformers, base and with a PEFT adapter."""

from __future__ import annotations

import shutil

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)

FAMILIES = {
    "llama3_rope": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2_tied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
}


def build(kind: str, folder, demo_model):
    torch.manual_seed(7)
    config = FAMILIES[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    # Shard it so the index path is exercised.
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, folder / name)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                                                     init_lora_weights=False))
    lora.save_pretrained(str(folder / "adapter"))
    return lora.eval()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_family_matches_transformers(kind, tmp_path, demo_model):
    folder = tmp_path / kind
    peft_model = build(kind, folder, demo_model)
    assert (folder / "model.safetensors.index.json").exists()
    engine = LLMEngine(folder, EngineConfig(max_loras=2, dtype="float32"), lora_modules={"a": str(folder / "adapter")})
    rows = []
    engine.logits_hook = lambda seqs, logits: rows.extend(zip([s.seq_id for s in seqs], logits.clone()))
    prompt = list(range(5, 90))  # past original_max_position_embeddings, so llama3 scaling matters
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = engine.generate([prompt, prompt], sp, [(), (("a", 1.0),)])
    for rid, (out, with_adapter) in enumerate(zip(outs, (False, True))):
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            if with_adapter:
                want = peft_model(ids).logits[0, len(prompt) - 1 :]
            else:
                with peft_model.disable_adapter():
                    want = peft_model(ids).logits[0, len(prompt) - 1 :]
        got = torch.stack([row for sid, row in rows if sid == rid])
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= 1e-4, f"{kind} adapter={with_adapter}: relative error {err:.2e}"

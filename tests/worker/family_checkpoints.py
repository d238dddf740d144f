"""Tiny random checkpoints of every served family, made with transformers (fp32), each with a PEFT
LoRA adapter on the family's own modules; and transformers + PEFT as their oracle.

Small on purpose (2 layers, hidden 64, head_dim 16, vocab 512): sliding windows (8 tokens) are
shorter than the test prompts so they matter, and Gemma 2's soft-capping values are low enough to
bite (`soft_capping_bites` checks it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

WINDOW = 8
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
              pad_token_id=0)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Family:
    config: str  # transformers' config class
    kwargs: dict
    targets: tuple[str, ...] = tuple(LLAMA_TARGETS)
    architecture: str = ""  # the class transformers saves in config.json


def _longrope(head_dim: int) -> dict:
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.0 + 0.5 * i for i in range(half)]}


FAMILIES: dict[str, Family] = {
    "llama3_rope": Family("LlamaConfig", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), architecture="LlamaForCausalLM"),
    "mistral_window": Family("MistralConfig", dict(sliding_window=WINDOW), architecture="MistralForCausalLM"),
    "qwen2_tied": Family("Qwen2Config", dict(tie_word_embeddings=True, head_dim=None), architecture="Qwen2ForCausalLM"),
    "qwen3": Family("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                    architecture="Qwen3ForCausalLM"),
    "gemma2": Family("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                                          final_logit_softcapping=2.0), architecture="Gemma2ForCausalLM"),
    "gemma3_text": Family("Gemma3TextConfig", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
        architecture="Gemma3ForCausalLM"),
    "phi3_longrope": Family("Phi3Config", dict(sliding_window=WINDOW + 4, rope_parameters=_longrope(16)),
                            targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), architecture="Phi3ForCausalLM"),
}


def hf_config(kind: str):
    import transformers

    fam = FAMILIES[kind]
    kwargs = {**COMMON, **fam.kwargs}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    config = getattr(transformers, fam.config)(**kwargs)
    config.architectures = [fam.architecture]
    return config


def build(kind: str, folder: Path, tokenizer_from: Path, shard: bool = False):
    """Save a random fp32 checkpoint of `kind` and its adapter (folder/adapter) -> the PEFT model (eval)."""
    import peft
    import transformers

    torch.manual_seed(7)
    config = hf_config(kind)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder), max_shard_size="100KB" if shard else "50GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(FAMILIES[kind].targets),
                                                     init_lora_weights=False))
    with torch.no_grad():  # A and B drawn at the base weights' scale, so the adapter moves the logits clearly
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    lora.save_pretrained(str(folder / "adapter"))
    return lora.eval()


def oracle_logprobs(peft_model, ids: list[int], with_adapter: bool) -> torch.Tensor:
    """log-softmax of transformers (+ PEFT) at every position of `ids`, `[len(ids), vocab]` float64."""
    with torch.no_grad():
        if with_adapter:
            logits = peft_model(torch.tensor([ids])).logits[0]
        else:
            with peft_model.disable_adapter():
                logits = peft_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def soft_capping_bites(peft_model, ids: list[int]) -> float:
    """How much Gemma 2's logits move when its soft-capping is switched off (max |Δ logprob|)."""
    base = peft_model.get_base_model()
    with_caps = oracle_logprobs(peft_model, ids, False)
    saved = base.config.attn_logit_softcapping, base.config.final_logit_softcapping
    for layer in base.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    base.config.final_logit_softcapping = None
    try:
        without = oracle_logprobs(peft_model, ids, False)
    finally:
        for layer in base.model.layers:
            layer.self_attn.attn_logit_softcapping = saved[0]
        base.config.final_logit_softcapping = saved[1]
    return float((with_caps - without).abs().max())

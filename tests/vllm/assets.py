"""A tiny random Llama that vLLM's CPU backend accepts (fp32, head_dim 32) and PEFT adapters for it.

The demo model (`lorafleet demo-assets`) has head_dim 16, which vLLM's CPU attention refuses; this
one keeps the demo's tokenizer (the BOS case: `add_bos_token: true` in tokenizer_config.json, no
post-processor in tokenizer.json) and its adapter builder, with two attention heads of 32.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.worker.demo_assets import ATTN, MLP, DemoAdapter, build_adapter, build_tokenizer

SEED = 4321

# Different ranks and target modules; all within one --max-lora-rank.
ORACLE_ADAPTERS = (
    DemoAdapter("sql", r=8, alpha=16, targets=ATTN),
    DemoAdapter("chat", r=16, alpha=32, targets=ATTN + MLP),
    DemoAdapter("poem", r=4, alpha=8, targets=MLP),
    DemoAdapter("code", r=32, alpha=16, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True),
)
MAX_LORA_RANK = 32

MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32
    num_key_value_heads=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_vllm_assets(out: Path) -> Path:
    """Write `out/model` and `out/adapters/<name>` once; returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    marker = out / ".complete"
    if marker.exists():
        return out
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(model_dir)
    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, **MODEL_CONFIG)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider than the default init so greedy text depends on the adapter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.to(torch.float32).save_pretrained(str(model_dir), safe_serialization=True)
    for i, spec in enumerate(ORACLE_ADAPTERS):
        build_adapter(model, spec, out / "adapters" / spec.name, seed=SEED + 1 + i)
    marker.write_text("ok\n")
    return out

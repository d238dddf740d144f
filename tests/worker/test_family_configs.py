"""config.json -> ModelConfig for each family, as the checkpoints on the Hub write them (older
transformers' field names included): which layers have windows, RoPE bases and scaling, caps."""

from __future__ import annotations

import math

import pytest

from lorafleet.worker.config import ConfigError, ModelConfig, rope_inv_freq

BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
FULL, SLIDE = "full_attention", "sliding_attention"


def parse(**raw) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **raw})


@pytest.mark.parametrize("raw,windows", [
    # Mistral v0.1: a window on every layer; v0.2+: none.
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096), [4096] * 6),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None), [None] * 6),
    # Qwen2/Qwen3 ship a sliding_window with use_sliding_window false: no window anywhere.
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=32768, use_sliding_window=False,
          max_window_layers=28), [None] * 6),
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", sliding_window=16, use_sliding_window=True,
          max_window_layers=4), [None] * 4 + [16] * 2),
    # Gemma 2: even layers local; Gemma 3 (transformers 4.5x): every sixth layer global.
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=4096), [4096, None] * 3),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=512,
          sliding_window_pattern=6), [512] * 5 + [None]),
    # transformers 5 writes layer_types: they win.
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=512,
          layer_types=[SLIDE, FULL] * 3), [512, None] * 3),
    # Phi-3-mini-4k: a 2047-token window on every layer.
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=2047), [2047] * 6),
])
def test_windows_per_layer(raw, windows):
    c = parse(**raw)
    assert [c.window(i) for i in range(c.num_layers)] == windows


def test_gemma3_older_config_rope_bases_and_global_scaling():
    c = parse(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", rope_theta=1_000_000.0,
              rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
              query_pre_attn_scalar=256, sliding_window=512)
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4
    assert rope_inv_freq(c)[1] == pytest.approx(1e6 ** (-2 / 16) / 8)  # global: linear scaling
    assert rope_inv_freq(c, local=True)[1] == pytest.approx(1e4 ** (-2 / 16))  # local: its own base, unscaled
    assert c.attention_scale == 256**-0.5 and c.qk_norm and c.tie_word_embeddings


def test_gemma3_transformers5_rope_parameters_per_layer_type():
    c = parse(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", rope_parameters={
        SLIDE: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling.rope_type, c.rope_scaling.factor) == (1e6, 1e4, "linear", 8)


def test_phi3_su_scaling_with_top_level_original_length():
    half = 8
    c = parse(architectures=["Phi3ForCausalLM"], model_type="phi3", max_position_embeddings=131072,
              original_max_position_embeddings=4096,
              rope_scaling={"type": "su", "short_factor": [1.0] * half, "long_factor": [2.0] * half})
    s = c.rope_scaling
    assert s.rope_type == "longrope" and s.original_max_position_embeddings == 4096 and s.factor == 32
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert rope_inv_freq(c, long=True)[1] == pytest.approx(rope_inv_freq(c)[1] / 2)
    assert c.adapter_targets["qkv_proj"] == ("q_proj", "k_proj", "v_proj")
    assert c.linear_shape("qkv_proj") == (c.q_size + 2 * c.kv_size, c.hidden_size)


def test_gemma2_caps_and_activation():
    c = parse(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
              hidden_act="gelu_pytorch_tanh", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              query_pre_attn_scalar=224)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.hidden_act) == (50.0, 30.0, "gelu_pytorch_tanh")
    assert c.attention_scale == 224**-0.5


@pytest.mark.parametrize("raw,message", [
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}), "partial_rotary_factor"),
    (dict(architectures=["LlamaForCausalLM"], model_type="qwen2"), "model_type 'qwen2'"),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="relu"), "activation"),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4}),
     "yarn"),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8, layer_types=[FULL]),
     "layer_types"),
])
def test_refused_with_a_reason(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse(**raw)

"""The accepted-config table against PEFT: every `LoraConfig` field classified, PEFT's own defaults
served, each IRRELEVANT key shown not to move PEFT's logits, each REFUSED key shown to move them
(or to be a setting PEFT itself rejects for this model), each IMPLEMENTED key served with PEFT's
logits by the engine."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.lora.config_rules import IMPLEMENTED, IRRELEVANT, REFUSED, RULES, check_config_keys
from lorafleet.worker.lora.errors import AdapterError

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from .peft_oracle import load_hf_base, rel_err, run_engine_with_logits  # noqa: E402

BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
IDS = [3, 17, 40, 99, 5, 250, 7]

# A value other than PEFT's default for each IRRELEVANT key: PEFT's logits must not move.
IRRELEVANT_SAMPLES = {
    "task_type": "CAUSAL_LM", "auto_mapping": {"base_model_class": "LlamaForCausalLM"}, "peft_version": "0.1.0",
    "base_model_name_or_path": "someone/other-model", "revision": "v2", "inference_mode": True,
    "lora_dropout": 0.3, "megatron_core": "other.core", "qalora_group_size": 64, "ensure_weight_tying": True,
    "loftq_config": {"loftq_bits": 4},
}
# Irrelevant to the maths, but PEFT fails on any value of it read from a file: never served.
NEVER_IN_A_FILE = {"runtime_config": [None, {"ephemeral_gpu_offload": False}]}
# A value that turns each REFUSED key on: PEFT's logits move (or PEFT refuses it on this model).
REFUSED_SAMPLES = {
    "init_lora_weights": "pissa", "bias": "all", "lora_bias": True, "fan_in_fan_out": True,
    "use_qalora": True, "layer_replication": [[0, 1], [0, 2]], "target_parameters": ["mlp.down_proj.weight"],
    "trainable_token_indices": [3, 17], "modules_to_save": ["lm_head"], "exclude_modules": ["down_proj"],
    "layers_to_transform": [1], "layers_pattern": "layers", "megatron_config": {"tensor_model_parallel_size": 1},
    "alora_invocation_tokens": [17, 40], "use_bdlora": {"nblocks": 2}, "arrow_config": {"top_k": 1},
    "kasa_config": {}, "monteclora_config": {}, "velora_config": {}, "eva_config": {}, "corda_config": {},
    "lora_ga_config": {}, "astra_config": {},
}
# Shown by what PEFT does with them, not by a logit comparison here: qalora needs a quantized base,
# arrow several adapters, megatron a Megatron model, the init-only configs the data they are fitted to.
# `bias` saves trained base biases: the demo Llama has none (qwen2's qkv biases would move).
NOT_COMPARED = {"bias", "use_qalora", "arrow_config", "megatron_config", "eva_config", "corda_config", "lora_ga_config",
                "velora_config", "monteclora_config", "layers_pattern", "fan_in_fan_out", "astra_config"}


def peft_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(peft.LoraConfig)}


def test_every_peft_field_is_classified():
    """A new PEFT release's field must be classified before its adapters are served."""
    assert peft_fields() - set(RULES) == set(), "LoraConfig fields missing from config_rules.RULES"
    assert set(RULES) - peft_fields() == set(), "rules for keys LoraConfig no longer has"
    assert {r.kind for r in RULES.values()} == {IMPLEMENTED, IRRELEVANT, REFUSED}
    assert set(IRRELEVANT_SAMPLES) | set(NEVER_IN_A_FILE) == {k for k, r in RULES.items() if r.kind == IRRELEVANT}
    assert set(REFUSED_SAMPLES) == {k for k, r in RULES.items() if r.kind == REFUSED}


def test_the_config_peft_writes_is_served(tmp_path):
    """`save_pretrained`'s adapter_config.json (every field at PEFT's default) passes the table."""
    peft.LoraConfig(**{k: v for k, v in BASE.items() if k != "peft_type"}).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    check_config_keys(saved)
    for key, value in saved.items():
        assert key in RULES and RULES[key].accepts(value), key


@pytest.mark.parametrize("key", sorted(REFUSED_SAMPLES))
def test_refused_key_is_named(key):
    with pytest.raises(AdapterError) as info:
        check_config_keys({**BASE, key: REFUSED_SAMPLES[key]})
    assert info.value.reason == "unsupported" and repr(key) in str(info.value)


def test_unknown_keys_are_served_only_off():
    check_config_keys({**BASE, "a_future_flag": None, "another": False})
    for value in (True, 1, "on", {}, [], {"x": 1}):
        with pytest.raises(AdapterError, match="'a_future_flag'"):
            check_config_keys({**BASE, "a_future_flag": value})


@pytest.fixture(scope="module")
def hf_base(demo_model):
    return load_hf_base(demo_model)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """PEFT-named A/B for BASE's targets on the demo model (hidden 64, 4x16 q heads, 2x16 kv heads, 160 mlp)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (32, 64), "mlp.down_proj": (64, 160)}
    out = {}
    for layer in range(2):
        for mod, (o, i) in shapes.items():
            p = f"base_model.model.model.layers.{layer}.{mod}"
            out[f"{p}.lora_A.weight"] = torch.randn(4, i, generator=g) * 0.2
            out[f"{p}.lora_B.weight"] = torch.randn(o, 4, generator=g) * 0.2
    return out


def peft_logits(hf_base, cfg: dict, tensors: dict) -> torch.Tensor:
    config = peft.LoraConfig(**{k: v for k, v in cfg.items() if k != "peft_type"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(hf_base), config)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # what a variant adds (magnitudes, lora_B biases) trained, not at its init
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.2)
        peft.set_peft_model_state_dict(model, tensors)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


@pytest.mark.parametrize("key", sorted(IRRELEVANT_SAMPLES))
def test_irrelevant_key_does_not_move_peft(key, hf_base):
    tensors = _weights()
    want = peft_logits(hf_base, BASE, tensors)
    got = peft_logits(hf_base, {**BASE, key: IRRELEVANT_SAMPLES[key]}, tensors)
    assert torch.equal(got, want)
    check_config_keys({**BASE, key: IRRELEVANT_SAMPLES[key]})  # and it is served


@pytest.mark.parametrize("key", sorted(NEVER_IN_A_FILE))
def test_keys_peft_cannot_read_are_refused(key, hf_base):
    for value in NEVER_IN_A_FILE[key]:
        with pytest.raises((AttributeError, TypeError, ValueError)):
            peft_logits(hf_base, {**BASE, key: value}, _weights())
        with pytest.raises(AdapterError, match=repr(key)):
            check_config_keys({**BASE, key: value})


@pytest.mark.parametrize("key", sorted(set(REFUSED_SAMPLES) - NOT_COMPARED))
def test_refused_key_moves_peft(key, hf_base):
    tensors = _weights()
    plain = peft_logits(hf_base, BASE, tensors)
    try:
        variant = peft_logits(hf_base, {**BASE, key: REFUSED_SAMPLES[key]}, tensors)
    except (ValueError, TypeError, NotImplementedError, KeyError, AttributeError, RuntimeError):
        return  # PEFT refuses it on this model too: serving it as plain LoRA would be wrong either way
    assert not torch.allclose(variant, plain, atol=1e-6), f"{key} did not change PEFT's output"


IMPLEMENTED_CASES = {
    "r": {"r": 4},
    "lora_alpha": {"lora_alpha": 3.5},
    "use_rslora": {"use_rslora": True},
    "rank_pattern": {"rank_pattern": {"v_proj": 2, r"layers\.1\.mlp\.down_proj": 3}},
    "alpha_pattern": {"alpha_pattern": {"q_proj": 1.0, "layers.0.mlp.down_proj": 20}},
    "target_modules_suffix": {"target_modules": ["self_attn.q_proj", "v_proj", "mlp.down_proj"]},
    "target_modules_regex": {"target_modules": r"model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"},
    "target_modules_all_linear": {"target_modules": "all-linear"},
    "use_dora": {"use_dora": True},
    "use_dora_rank_pattern": {"use_dora": True, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"q_proj": 1.0}},
}


@pytest.mark.parametrize("case", sorted(IMPLEMENTED_CASES))
def test_implemented_key_matches_peft(case, hf_base, demo_model, tmp_path):
    """PEFT writes the adapter (its own names and shapes for this config), the engine serves it
    with PEFT's logits."""
    cfg = {**BASE, **IMPLEMENTED_CASES[case]}
    config = peft.LoraConfig(**{k: v for k, v in cfg.items() if k != "peft_type"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(hf_base), config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    model.save_pretrained(tmp_path / "a")
    model.eval()
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0, -1].float()
    engine = LLMEngine(demo_model, EngineConfig(max_loras=1, max_cpu_loras=1, dtype="float32"),
                       lora_modules={"a": str(tmp_path / "a")})
    run = run_engine_with_logits(engine, [(IDS, (("a", 1.0),))], SamplingParams(max_tokens=1, temperature=0.0))
    got = run["steps"][run["ids"][0]][0]
    assert rel_err(got, want) < 1e-4

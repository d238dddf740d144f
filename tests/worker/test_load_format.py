"""vLLM's `--load-format dummy` (worker/models/dummy.py): random weights with the names and shapes of
the checkpoint that transformers saves for every served family, served from a folder holding only
config.json and the tokenizer, as bf16 and FP8, unsharded and over 2 tensor-parallel ranks (which must
draw the same whole tensors); and the flag's refusals. (tests/bench/test_serve.py: a Llama's dummy
weights are bench/engine_build.py's `random_weights`.)"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.models.dummy import dummy_checkpoint, layer_names, tensor_shape
from lorafleet.worker.models.llama import _short_name, iter_checkpoint
from lorafleet.worker.models.registry import model_class
from lorafleet.worker.server.cli import build_parser, settings_from_args

pytest.importorskip("transformers")

from .family_checkpoints import FAMILIES, build  # noqa: E402

CPU = torch.device("cpu")


def config_only(src, dst):
    """A copy of model folder `src` without its weights: config.json and the tokenizer."""
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(p, dst / p.name)
    return dst


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_dummy_tensors_are_the_checkpoints_names_and_shapes(kind, tmp_path, demo_model):
    folder = tmp_path / kind
    build(kind, folder, demo_model)
    config = ModelConfig.from_folder(folder)
    model = model_class(config)(config, CPU, torch.float32, 64)
    saved = {name: tuple(t.shape) for name, t in iter_checkpoint(str(folder))
             if _short_name(name) is not None and "rotary_emb" not in name}
    made = {name: tuple(t.shape) for name, t in dummy_checkpoint(model, config, CPU, torch.float32)}
    assert made == saved


def _tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300,
                                      hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2))


def test_an_unknown_tensor_name_is_refused_by_name():
    with pytest.raises(ValueError, match="no shape known for the checkpoint tensor 'layers.0.mlp.experts.w1'"):
        tensor_shape(_tiny_config(), "layers.0.mlp.experts.w1")


def test_a_layers_names_come_from_the_familys_loader():
    config = _tiny_config()
    model = model_class(config)(config, CPU, torch.float32, 64)
    assert layer_names(model, config) == [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [
        f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")] + ["input_layernorm.weight",
                                                                  "post_attention_layernorm.weight"]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_an_engine_serves_dummy_weights_from_a_folder_without_weights(tmp_path, demo_model, quantization, device):
    folder = config_only(demo_model, tmp_path / "model")
    config = EngineConfig(dtype="float32" if device == "cpu" else "bfloat16", num_kv_blocks=16, block_size=16,
                          max_num_batched_tokens=64, load_format="dummy", quantization=quantization, device=device)
    engine = LLMEngine(folder, config)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    again = LLMEngine(folder, config).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                              ignore_eos=True))
    assert again[0].token_ids == out[0].token_ids  # the same seed, the same weights
    with pytest.raises(ValueError, match="--load-format dummy"):
        LLMEngine(folder, dataclasses.replace(config, load_format="auto"))


def test_tensor_parallel_ranks_draw_the_same_dummy_weights(tmp_path):
    from lorafleet.worker.demo_assets import build_tokenizer
    from tests.worker.test_tensor_parallel import _model, assert_same_outputs, run_sharded

    src = tmp_path / "src"
    src.mkdir()
    _model(src, build_tokenizer(src, 301))
    folder = config_only(src, tmp_path / "model")
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, warmup=False,
                          load_format="dummy", max_loras=1)
    prompts = [[3, 4, 5, 6, 7], [9, 10, 11]]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    reference = LLMEngine(folder, config).generate(prompts, params)
    got = run_sharded(folder, dataclasses.replace(config, tensor_parallel_size=2), {},
                      lambda engine: engine.generate(prompts, params))
    assert_same_outputs(reference, got)


def test_the_flag_names_vllms_formats_it_does_not_implement(demo_model):
    args = build_parser().parse_args(["--model", str(demo_model), "--load-format", "gguf"])
    with pytest.raises(ConfigError, match=r"--load-format 'gguf': one of auto, safetensors, dummy"):
        settings_from_args(args)
    args = build_parser().parse_args(["--model", str(demo_model), "--load-format", "dummy"])
    assert settings_from_args(args).engine.load_format == "dummy"

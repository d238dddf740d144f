"""How the KV cache is sized on CUDA, with the device's memory figures made up (no GPU needed):
`kv_cache_memory_fraction` of what is free, or vLLM's `gpu_memory_utilization` of the whole GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig, RopeScaling
from lorafleet.worker.memory_plan import plan_kv_blocks

GIB = 1 << 30
MODEL = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                    rope_theta=10000.0, rope_scaling=RopeScaling(), qkv_bias=False, tie_word_embeddings=False,
                    bos_token_id=None, eos_token_ids=(0,))
PER_BLOCK = 1 << 20  # 1 MiB a block


@pytest.fixture
def gpu(monkeypatch):
    """A 100 GiB GPU with `used` GiB taken (by weights, slots, other processes)."""
    state = {"used": 30 * GIB}

    def mem_get_info(device=None):
        return 100 * GIB - state["used"], 100 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return state


def reserve(config: EngineConfig) -> int:
    return 4 * config.max_num_batched_tokens * MODEL.intermediate_size * 4 + GIB


def test_default_is_a_fraction_of_the_free_memory(gpu) -> None:
    config = EngineConfig(device="cuda")
    blocks = plan_kv_blocks(config, MODEL, torch.device("cuda"), PER_BLOCK)
    assert blocks == int((70 * GIB - reserve(config)) * 0.9) // PER_BLOCK


def test_gpu_memory_utilization_caps_the_whole_worker(gpu) -> None:
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.5)
    blocks = plan_kv_blocks(config, MODEL, torch.device("cuda"), PER_BLOCK)
    assert blocks == (50 * GIB - 30 * GIB - reserve(config)) // PER_BLOCK
    # What is in use counts against the share: 30 GiB used + KV + activations' room = 50 GiB.
    assert 30 * GIB + blocks * PER_BLOCK + reserve(config) <= 50 * GIB


def test_a_share_smaller_than_what_is_in_use_is_a_clear_error(gpu) -> None:
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.25)
    with pytest.raises(ConfigError) as info:
        plan_kv_blocks(config, MODEL, torch.device("cuda"), PER_BLOCK)
    message = str(info.value)
    assert "30.00 GiB of 100.00 GiB in use" in message and "--gpu-memory-utilization 0.25 allows 25.00 GiB" in message


def test_cpu_and_an_explicit_block_count_ignore_the_gpu(gpu) -> None:
    assert plan_kv_blocks(EngineConfig(num_kv_blocks=7, device="cuda"), MODEL, torch.device("cuda"), PER_BLOCK) == 7
    assert plan_kv_blocks(EngineConfig(gpu_memory_utilization=0.1), MODEL, torch.device("cpu"), PER_BLOCK) == 2048


@pytest.mark.parametrize("field, value", [("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5),
                                          ("kv_cache_memory_fraction", 0.0), ("kv_cache_memory_fraction", 2.0)])
def test_fractions_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be in"):
        dataclasses.replace(EngineConfig(), **{field: value})

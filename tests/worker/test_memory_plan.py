"""How the KV cache is sized on CUDA, with the device's memory figures made up (no GPU needed):
`kv_cache_memory_fraction` of what is free, or vLLM's per-worker `gpu_memory_utilization` share
(`lorafleet worker`'s default, vLLM's 0.92); on CPU a fixed number of tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig, RopeScaling
from lorafleet.worker.engine.memory_plan import activation_reserve, plan_kv_blocks
from lorafleet.worker.server.cli import build_parser, settings_from_args

GIB = 1 << 30
MODEL = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                    rope_theta=10000.0, rope_scaling=RopeScaling(), qkv_bias=False, tie_word_embeddings=False,
                    bos_token_id=None, eos_token_ids=(0,))
PER_BLOCK = 1 << 20  # 1 MiB a block
CUDA = torch.device("cuda")


@pytest.fixture
def gpu(monkeypatch):
    """A 100 GiB GPU with `used` GiB taken (by this worker's weights and slots, and other processes)."""
    state = {"used": 30 * GIB}

    def mem_get_info(device=None):
        return 100 * GIB - state["used"], 100 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return state


def reserve(config: EngineConfig) -> int:
    """Activations' room, a logit-edit row per sequence (float32 bias, int32 counts, bool prompt mask)
    and its sampled logits (half, float32 and probabilities), and 512 scored prompt rows of float32
    logits with a 256-row log-softmax slice (float32 copy, float32 result, bool mask)."""
    edits = config.max_num_seqs * MODEL.vocab_size * (9 + 10)
    scoring = (512 * 4 + 256 * 9) * MODEL.vocab_size
    return 4 * config.max_num_batched_tokens * MODEL.intermediate_size * 4 + GIB + edits + scoring


def test_default_is_a_fraction_of_the_free_memory(gpu) -> None:
    config = EngineConfig(device="cuda")
    blocks = plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=90 * GIB)
    assert blocks == int((70 * GIB - reserve(config)) * 0.9) // PER_BLOCK


def test_gpu_memory_utilization_is_this_workers_share(gpu) -> None:
    """Another process held 10 GiB at start, this worker's weights and slots took 20 since: the
    KV cache gets 50 GiB less those 20 and the activations' room; the other process is not charged."""
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.5)
    blocks = plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=90 * GIB)
    assert blocks == (50 * GIB - 20 * GIB - reserve(config)) // PER_BLOCK
    assert 20 * GIB + blocks * PER_BLOCK + reserve(config) <= 50 * GIB


def test_two_workers_at_045_share_a_gpu(gpu) -> None:
    """vLLM's example: the second worker starts with the first one's 45 GiB in use."""
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.45)
    gpu["used"] = 45 * GIB + 5 * GIB  # the first worker, then the second's own weights and slots
    blocks = plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=55 * GIB)
    assert blocks == (45 * GIB - 5 * GIB - reserve(config)) // PER_BLOCK


def test_a_share_larger_than_what_was_free_at_start_is_refused(gpu) -> None:
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.8)
    with pytest.raises(ConfigError) as info:
        plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=70 * GIB)
    assert "asks for 80.00 GiB of the GPU's 100.00 GiB, but only 70.00 GiB were free" in str(info.value)


def test_a_share_too_small_for_the_weights_says_to_raise_it(gpu) -> None:
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.2)
    with pytest.raises(ConfigError) as info:
        plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=100 * GIB)
    message = str(info.value)
    assert "weights and adapter slots take 30.00 GiB" in message and "raise it" in message


def test_cpu_and_an_explicit_block_count_ignore_the_gpu(gpu) -> None:
    assert plan_kv_blocks(EngineConfig(num_kv_blocks=7, device="cuda"), MODEL, CUDA, PER_BLOCK) == 7
    assert plan_kv_blocks(EngineConfig(gpu_memory_utilization=0.1), MODEL, torch.device("cpu"), PER_BLOCK) == 2048
    # vLLM's CPU block size keeps the same 32768 tokens
    assert plan_kv_blocks(EngineConfig(block_size=128), MODEL, torch.device("cpu"), PER_BLOCK) == 256


def test_the_decode_graphs_pool_is_kept_out_of_the_share(gpu) -> None:
    """The graphs' pool (activations and logits of their largest bucket) stays allocated once captured:
    inside the worker's share, so the KV cache is smaller by it."""
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.92)
    pool = 512 * (4 * MODEL.intermediate_size * 4 + MODEL.vocab_size * 6)
    assert activation_reserve(config, MODEL, 512) == reserve(config) + pool
    without = plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=100 * GIB)
    with_graphs = plan_kv_blocks(config, MODEL, CUDA, PER_BLOCK, baseline_free=100 * GIB, graph_rows=512)
    assert without == (92 * GIB - 30 * GIB - reserve(config)) // PER_BLOCK
    assert with_graphs == (92 * GIB - 30 * GIB - reserve(config) - pool) // PER_BLOCK


@pytest.mark.parametrize("field, value", [("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5),
                                          ("kv_cache_memory_fraction", 0.0), ("kv_cache_memory_fraction", 2.0)])
def test_fractions_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be in"):
        dataclasses.replace(EngineConfig(), **{field: value})


def test_the_flags_size_the_kv_cache_one_way_only(tmp_path) -> None:
    argv = ["--model", str(tmp_path)]
    assert settings_from_args(build_parser().parse_args(argv)).engine.gpu_memory_utilization == 0.92  # vLLM's
    fraction = settings_from_args(build_parser().parse_args(argv + ["--kv-cache-memory-fraction", "0.5"])).engine
    assert (fraction.gpu_memory_utilization, fraction.kv_cache_memory_fraction) == (None, 0.5)
    engine = settings_from_args(build_parser().parse_args(argv + ["--gpu-memory-utilization", "0.4"])).engine
    assert engine.gpu_memory_utilization == 0.4
    both = build_parser().parse_args(argv + ["--gpu-memory-utilization", "0.4", "--kv-cache-memory-fraction", "0.5"])
    with pytest.raises(ConfigError, match="give one"):
        settings_from_args(both)

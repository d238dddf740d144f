"""The defaults `lorafleet worker` takes from vLLM per device (worker/engine/device_setup.py) equal the
pinned table of what vLLM 0.32 resolves on each device (tests/worker/vllm_device_cases.py; the vLLM
tier re-derives it from vLLM's code), and an engine started with them on CPU runs with them."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from lorafleet.worker.config import EngineConfig, ModelConfig, RopeScaling
from lorafleet.worker.engine.device_setup import (
    DeviceInfo,
    device_info,
    resolve_device_defaults,
    resolve_dtype,
    resolved_defaults_line,
)
from lorafleet.worker.server.cli import build_parser, settings_from_args
from tests.worker.vllm_device_cases import DEVICE_CASES, DeviceCase

UNSET = EngineConfig(max_num_seqs=None, max_num_batched_tokens=None, block_size=None)


def model(family: str = "llama", dtype: str = "float32") -> ModelConfig:
    return ModelConfig(model_type=family, vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=RopeScaling(), qkv_bias=False, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_ids=(0,), torch_dtype=dtype)


def info(case: DeviceCase) -> DeviceInfo:
    return DeviceInfo(case.kind, case.name, case.total_memory, case.bf16)


def worker_config(case: DeviceCase) -> EngineConfig:
    """`lorafleet worker`'s engine settings for the case's command line."""
    argv = ["--model", "/m", "--tensor-parallel-size", str(case.world_size)]
    for key, value in case.given.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return settings_from_args(build_parser().parse_args(argv)).engine


@pytest.mark.parametrize("case", DEVICE_CASES, ids=lambda c: c.id)
def test_the_workers_defaults_resolve_to_vllms_for_the_device(case: DeviceCase):
    got = resolve_device_defaults(worker_config(case), info(case), case.max_model_len)
    assert (got.max_num_seqs, got.max_num_batched_tokens, got.block_size) == (
        case.max_num_seqs, case.max_num_batched_tokens, case.block_size)


@pytest.mark.parametrize("case", [c for c in DEVICE_CASES if c.dtypes], ids=lambda c: c.id)
def test_dtype_auto_is_vllms(case: DeviceCase):
    device = torch.device(case.kind)
    for key, want in case.dtypes.items():
        family, checkpoint = key.split("/")
        assert resolve_dtype("auto", model(family, checkpoint), device, case.bf16) == getattr(torch, want), key


def test_the_python_apis_defaults_stay_fixed_and_exact_on_cpu():
    """EngineConfig's defaults are not vLLM's: the same on every device, float32 on CPU."""
    fixed = EngineConfig()
    for case in DEVICE_CASES:
        got = resolve_device_defaults(fixed, info(case), case.max_model_len)
        assert (got.max_num_seqs, got.max_num_batched_tokens, got.block_size) == (64, 2048, 16)
    assert resolve_dtype(fixed.dtype, model(), torch.device("cpu")) == torch.float32
    assert resolve_dtype(fixed.dtype, model(), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", model(dtype="bfloat16"), torch.device("cuda")) == torch.float32


def test_the_worker_leaves_device_defaults_unset_and_given_flags_win():
    engine = settings_from_args(build_parser().parse_args(["--model", "/m"])).engine
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.block_size, engine.dtype) == (
        None, None, None, "auto")
    given = settings_from_args(build_parser().parse_args(
        ["--model", "/m", "--max-num-seqs", "7", "--max-num-batched-tokens", "1k", "--block-size", "32"])).engine
    cpu = resolve_device_defaults(given, DeviceInfo("cpu"), 4096)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.block_size) == (7, 1000, 32)


def test_start_up_logs_what_it_took_from_vllm():
    h100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 85_520_809_984)
    line = resolved_defaults_line(UNSET, resolve_device_defaults(UNSET, h100, 4096), h100)
    assert line == ("vLLM 0.32's defaults for NVIDIA H100 80GB HBM3 (80 GiB): --max-num-seqs 1024, "
                    "--max-num-batched-tokens 8192, --block-size 16")
    partly = replace(UNSET, max_num_seqs=8)
    assert "--max-num-seqs" not in resolved_defaults_line(partly, resolve_device_defaults(partly, h100, 4096), h100)
    assert resolved_defaults_line(EngineConfig(), EngineConfig(), h100) is None
    assert device_info(torch.device("cpu")) == DeviceInfo("cpu")


def test_an_engine_with_the_workers_defaults_runs_them_on_cpu(demo_model, caplog):
    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams

    with caplog.at_level(logging.INFO, logger="lorafleet.engine"):
        engine = LLMEngine(demo_model, replace(UNSET, dtype="auto"))
    c = engine.config
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.block_size) == (128, min(2048, 128 * engine.max_model_len), 128)
    assert engine.dtype == torch.bfloat16  # vLLM's auto on CPU for a float32 checkpoint
    assert engine.blocks.num_blocks == 32768 // 128  # the CPU cache keeps its 32768 tokens
    assert engine.scheduler.config.max_num_seqs == 128
    assert any("vLLM 0.32's defaults for CPU: --max-num-seqs 128" in r.getMessage() for r in caplog.records)
    out = engine.generate(["The router sends each request to"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out) == 1 and out[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_workers_defaults_on_this_gpu_start_and_serve_600_requests(demo_model):
    """`lorafleet worker --device cuda` with every other default: vLLM's limits for this card, 0.92 of
    its memory, the base graphs up to 512 rows captured at start-up; 600 requests at once run (more
    than a graph holds: eagerly) and answer as the same requests 40 at a time (from the graphs)."""
    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams

    settings = settings_from_args(build_parser().parse_args(["--model", str(demo_model), "--device", "cuda",
                                                             "--dtype", "float32"]))
    torch.cuda.empty_cache()  # earlier tests' cached blocks back to the device
    free_before = torch.cuda.mem_get_info()[0]  # what this process (earlier tests) already holds stays out
    engine = LLMEngine(demo_model, settings.engine)
    props = torch.cuda.get_device_properties(0)
    want = resolve_device_defaults(settings.engine, DeviceInfo("cuda", props.name, props.total_memory), engine.max_model_len)
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens, engine.config.block_size) == (
        want.max_num_seqs, want.max_num_batched_tokens, 16)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets[-1] == min(512, want.max_num_batched_tokens)
    assert graphs.stats.captures == len(graphs.buckets) <= 18  # the warm-up's base graphs
    free, total = torch.cuda.mem_get_info()
    # The share is the engine's own (vLLM's meaning), measured from what was free when it started.
    assert free_before - free <= 0.92 * total + (1 << 30)
    prompts = [f"request {i} says" for i in range(600)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    many = engine.generate(prompts, sp)
    few = [c for i in range(0, 600, 40) for c in engine.generate(prompts[i:i + 40], sp)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(many, few))
    assert same >= 594, same  # float32 both ways; other GEMM shapes may flip a near-tie or two

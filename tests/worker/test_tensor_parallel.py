"""Tensor parallelism on CPU over gloo: the engine as rank 0 of 2 and 4 processes against the same
engine unsharded (TP = 1), on a tiny random Llama with grouped-query attention (fewer KV heads than 4
ranks: replicated), a vocabulary no rank count divides (padded shards), adapters of several ranks and
targets, mixed batches and two adapters per request. Greedy tokens must be equal and the first step's
logprobs (and the prompt logprobs) within 1e-4."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
import torch.distributed as dist

from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.parallel import free_port, init_group, start_followers, stop
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.models.sharding import check_shardable, shard_config
from tests.worker.dora_checkpoints import build_dora
from tests.worker.lora_harness import write_adapter
from tests.worker.worker_harness import start_cli_worker

ADAPTERS = {"r4": dict(r=4, seed=1), "r16": dict(r=16, seed=2, targets=("q_proj", "v_proj", "o_proj", "down_proj")),
            "r8": dict(r=8, seed=3, rank_pattern={"model.layers.1.mlp.up_proj": 2})}
# "dora": a DoRA adapter on all seven targets (its scales need the row-parallel norms all-reduced and
# its epilogue runs after o/down's all-reduce); the last request is the first one's prompt with it.
REQUESTS = [(), (("r4", 1.0),), (("r16", 1.0),), (("r4", 0.5), ("r8", 0.7)), (("r8", 1.0),), (("dora", 1.0),),
            (("r16", 0.3),), (("dora", 1.0),)]


def _model(folder, vocab: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(folder), safe_serialization=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from lorafleet.worker.demo_assets import build_tokenizer

    root = tmp_path_factory.mktemp("tp")
    model_dir = root / "model"
    model_dir.mkdir()
    vocab = build_tokenizer(model_dir, 301)
    assert vocab % 2 and vocab % 4, "a vocabulary the rank counts do not divide"
    _model(model_dir, vocab)
    config = ModelConfig.from_folder(model_dir)
    adapters = {name: str(write_adapter(root / name, config, torch.float32, alpha=16.0, **kw))
                for name, kw in ADAPTERS.items()}
    build_dora("llama3_rope", model_dir)
    adapters["dora"] = str(model_dir / "dora")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 20)]
    prompts.append(prompts[0])
    return model_dir, adapters, prompts


def _engine_config(tp: int) -> EngineConfig:
    # Two slots for three adapters: fills and evictions happen between steps.
    return EngineConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=16, max_loras_per_request=2, device="cpu",
                        dtype="float32", num_kv_blocks=64, block_size=8, warmup=False, tensor_parallel_size=tp)


def _run(engine: LLMEngine, prompts):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    return engine.generate(prompts, params, REQUESTS)


@pytest.fixture(scope="module")
def reference(assets):
    model_dir, adapters, prompts = assets
    return _run(LLMEngine(model_dir, _engine_config(1), lora_modules=adapters), prompts)


def run_sharded(model_dir, config: EngineConfig, adapters: dict[str, str], fn):
    """fn(engine), the engine rank 0 of `config.tensor_parallel_size` gloo processes -> what fn returned;
    the other ranks must stop cleanly."""
    tp = config.tensor_parallel_size
    init = f"tcp://127.0.0.1:{free_port()}"
    followers = start_followers(model_dir, config, init)
    group = init_group(0, tp, init, torch.device("cpu"), timeout_s=120)
    try:
        result = fn(LLMEngine(model_dir, config, lora_modules=adapters, group=group))
        stop(group)
    finally:
        dist.destroy_process_group()
        codes = [_wait_or_kill(p) for p in followers]
    assert codes == [0] * (tp - 1)
    return result


def assert_same_outputs(reference, got, tolerance: float = 1e-4) -> None:
    """Greedy tokens equal; the first step's logprobs (its top ones too) and the prompt logprobs within `tolerance`."""
    for want, have in zip(reference, got, strict=True):
        assert have.token_ids == want.token_ids
        first_w, first_h = want.logprobs[0], have.logprobs[0]
        assert abs(first_w.logprob - first_h.logprob) < tolerance
        assert [t for t, _ in first_w.top] == [t for t, _ in first_h.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(first_w.top, first_h.top)) < tolerance
        pairs = [(a.logprob, b.logprob) for a, b in zip(want.prompt_logprobs or [], have.prompt_logprobs or [])
                 if a is not None and a.logprob is not None]
        assert not want.prompt_logprobs or (pairs and max(abs(a - b) for a, b in pairs) < tolerance)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_engine_matches_tp1(assets, reference, tp):
    model_dir, adapters, prompts = assets
    got = run_sharded(model_dir, _engine_config(tp), adapters, lambda engine: _run(engine, prompts))
    assert_same_outputs(reference, got)
    # The adapters change the output (so equality above says the sharded LoRA path is right), DoRA too.
    assert len({tuple(c.token_ids) for c in reference}) > 3
    assert abs(reference[7].logprobs[0].logprob - reference[0].logprobs[0].logprob) > 1e-2


def _wait_or_kill(p: subprocess.Popen) -> int | None:
    try:
        return p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


_START_A_DYING_GROUP = """
import sys, torch.distributed as dist
from lorafleet.worker.config import ConfigError
from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.parallel import Ranks
try:
    Ranks.start(sys.argv[1], EngineConfig(device="cpu", dtype="float32", tensor_parallel_size=2))
except ConfigError as e:
    print(e)
    sys.exit(3 if dist.is_initialized() else 0)
sys.exit(4)
"""


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(tmp_path):
    # In a process of its own: rank 0's join stays blocked in its thread until the group's timeout,
    # which would hold up every process group this test process makes after it.
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _START_A_DYING_GROUP, str(tmp_path / "no-model")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 1 exited with code 1 before joining" in done.stdout
    assert time.monotonic() - started < 60  # not the group's timeout (600 s)


def test_shard_config_and_refusals(assets):
    config = ModelConfig.from_folder(assets[0])
    shard = shard_config(config, 4)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (1, 1, 24)
    with pytest.raises(ConfigError, match="attention heads"):
        check_shardable(config, 8)
    with pytest.raises(ConfigError, match="intermediate size 90"):
        check_shardable(dataclasses.replace(config, intermediate_size=90), 4)
    with pytest.raises(ConfigError, match="newfamily family is not sharded"):
        check_shardable(dataclasses.replace(config, model_type="newfamily"), 2)


def _start_worker(model_dir, adapters, tp: int) -> tuple[subprocess.Popen, str]:
    return start_cli_worker(["--model", str(model_dir), "--served-model-name", "tiny", "--device", "cpu",
                             "--dtype", "float32", "--tensor-parallel-size", str(tp), "--max-loras", "2",
                             "--max-lora-rank", "16", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                             "--log-level", "warning"], f"worker -tp {tp}")


def test_worker_http_tp2_serves_like_tp1_and_stops_when_a_rank_dies(assets, reference):
    model_dir, adapters, prompts = assets
    proc, url = _start_worker(model_dir, adapters, 2)
    try:
        for i in (0, 1, 3):  # no adapter, one, two with scales
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 6, "temperature": 0, "logprobs": 3}
            if REQUESTS[i]:
                body["lora_adapters"] = [{"name": n, "scale": s} for n, s in REQUESTS[i]]
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == reference[i].text
            assert abs(choice["logprobs"]["token_logprobs"][0] - reference[i].logprobs[0].logprob) < 1e-4
        children = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        (rank1,) = [int(line.split()[0]) for line in children.stdout.splitlines()
                    if "lorafleet.worker.engine.parallel" in line]
        os.kill(rank1, signal.SIGKILL)
        code = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
        assert code != 0
        assert "tensor-parallel rank 1 of 2 exited" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

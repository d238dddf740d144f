"""The engine's logits, for a batch mixing adapters, base-only and composed requests, against
transformers + PEFT running each request alone (fp32)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

pytest.importorskip("peft")
pytest.importorskip("transformers")

from .peft_oracle import load_hf_base, oracle_logits, rel_err, run_engine_with_logits  # noqa: E402

TOLERANCE = 1e-4  # max |engine - oracle| / max |oracle| over the vocabulary, per step


@pytest.fixture(scope="module")
def hf_base(demo_model):
    return load_hf_base(demo_model)


REQUESTS = [
    ("Hello world", ()),
    ("SELECT name FROM students", (("sql", 1.0),)),
    ("The router sends each request to a worker", (("chat", 1.0),)),
    ("Roses are red", (("poem", 1.0),)),
    ("def add(a, b):", (("code", 1.0),)),
    ("Hello world", (("sql", 1.0),)),  # same prompt as the base request: no prefix sharing across adapters
    ("Once upon a time " * 12, ()),  # long: prefilled in chunks under the token budget
    ("Every institute uses the same printed textbook", (("sql", 0.7), ("poem", 0.5))),  # composed (RFC)
    ("A tenant sends a request", (("legal", 1.0),)),  # rank_pattern
]


def check_against_oracle(run, hf_base, demo_adapters, requests, tolerance, exact_tokens=True, metric=rel_err):
    for (prompt, adapters), rid in zip(requests, run["ids"]):
        seq = run["seqs"][rid]
        got = torch.stack(run["steps"][rid])  # [max_tokens, vocab]
        full = seq.prompt_ids + seq.output_ids[:-1]
        want = oracle_logits(hf_base, demo_adapters, adapters, full)[len(seq.prompt_ids) - 1 :]
        assert got.shape == want.shape
        for step, (g, w) in enumerate(zip(got, want)):
            err = metric(g, w)
            assert err <= tolerance, f"{prompt!r} {adapters} step {step}: relative error {err:.2e}"
        if exact_tokens:  # greedy decoding picked the oracle's argmax every step
            assert seq.output_ids == want.argmax(-1).tolist()


def test_mixed_batch_matches_peft_per_request(demo_model, demo_adapters, hf_base):
    config = EngineConfig(max_loras=6, max_cpu_loras=8, max_num_batched_tokens=48, block_size=16, dtype="float32")
    engine = LLMEngine(demo_model, config, lora_modules={n: str(p) for n, p in demo_adapters.items()})
    run = run_engine_with_logits(engine, REQUESTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert run["max_running"] == len(REQUESTS), "all requests should have shared a batch"
    assert len({n for _, a in REQUESTS for n, _ in a}) >= 5
    check_against_oracle(run, hf_base, demo_adapters, REQUESTS, TOLERANCE)


def test_adapters_change_the_output(demo_model, demo_adapters):
    engine = LLMEngine(demo_model, EngineConfig(max_loras=4), lora_modules={n: str(p) for n, p in demo_adapters.items()})
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    names = ["sql", "chat", "poem", "code"]
    outs = engine.generate(["Hello world"] * 5, sp, [()] + [((n, 1.0),) for n in names])
    token_runs = {tuple(o.token_ids) for o in outs}
    assert len(token_runs) == 5, "every adapter (and the base) should decode differently"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_the_fp32_oracle(dtype, demo_model, demo_adapters, hf_base):
    """bf16 / fp16 weights and KV cache on CPU: same function within half-precision rounding."""
    from .peft_oracle import rel_norm_err

    config = EngineConfig(max_loras=6, max_cpu_loras=8, dtype=dtype)
    engine = LLMEngine(demo_model, config, lora_modules={n: str(p) for n, p in demo_adapters.items()})
    assert engine.model.weights["embed"].dtype == getattr(torch, dtype)
    requests = REQUESTS[:4] + REQUESTS[7:8]  # base, three adapters, composed
    run = run_engine_with_logits(engine, requests, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    check_against_oracle(run, hf_base, demo_adapters, requests, 5e-2, exact_tokens=False, metric=rel_norm_err)

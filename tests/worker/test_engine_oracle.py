"""The engine's logits, for a batch mixing adapters, base-only and composed requests, against
transformers + PEFT running each request alone (fp32)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine import LLMEngine
from lorafleet.worker.sequence import SamplingParams

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |engine - oracle| / max |oracle| over the vocabulary, per step


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def hf_base(demo_model):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(demo_model), torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def oracle_logits(base, demo_adapters, adapters, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids` from transformers (+ PEFT) for one request alone."""
    import copy

    model = copy.deepcopy(base)
    if adapters:
        names = [n for n, _ in adapters]
        model = peft.PeftModel.from_pretrained(model, str(demo_adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(demo_adapters[name]), adapter_name=name)
        if len(adapters) > 1 or adapters[0][1] != 1.0:
            model.add_weighted_adapter(names, [s for _, s in adapters], adapter_name="combo", combination_type="cat")
            model.set_adapter("combo")
        else:
            model.set_adapter(names[0])
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


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


def test_mixed_batch_matches_peft_per_request(demo_model, demo_adapters, hf_base):
    config = EngineConfig(max_loras=6, max_cpu_loras=8, max_num_batched_tokens=48, block_size=16, dtype="float32")
    engine = LLMEngine(demo_model, config, lora_modules={n: str(p) for n, p in demo_adapters.items()})
    steps: dict[int, list[torch.Tensor]] = {}

    def hook(seqs, logits):
        for seq, row in zip(seqs, logits):
            steps.setdefault(seq.seq_id, []).append(row.clone())

    engine.logits_hook = hook
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, sp, adapters) for prompt, adapters in REQUESTS]
    seqs = {rid: engine._tracked[rid].seq for rid in ids}
    batch_sizes = []
    while engine.has_unfinished():
        engine.step()
        batch_sizes.append(len(engine.scheduler.running))
    assert max(batch_sizes) == len(REQUESTS), "all requests should have shared a batch"
    distinct = {n for _, a in REQUESTS for n, _ in a}
    assert len(distinct) >= 5

    for (prompt, adapters), rid in zip(REQUESTS, ids):
        seq = seqs[rid]
        got = torch.stack(steps[rid])  # [max_tokens, vocab]
        full = seq.prompt_ids + seq.output_ids[:-1]
        want = oracle_logits(hf_base, demo_adapters, adapters, full)[len(seq.prompt_ids) - 1 :]
        assert got.shape == want.shape
        for step, (g, w) in enumerate(zip(got, want)):
            err = _rel_err(g, w)
            assert err <= TOLERANCE, f"{prompt!r} {adapters} step {step}: relative error {err:.2e}"
        # Greedy decoding picked the oracle's argmax every step.
        assert seq.output_ids == want.argmax(-1).tolist()


def test_adapters_change_the_output(demo_model, demo_adapters):
    engine = LLMEngine(demo_model, EngineConfig(max_loras=4), lora_modules={n: str(p) for n, p in demo_adapters.items()})
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    names = ["sql", "chat", "poem", "code"]
    outs = engine.generate(["Hello world"] * 5, sp, [()] + [((n, 1.0),) for n in names])
    token_runs = {tuple(o.token_ids) for o in outs}
    assert len(token_runs) == 5, "every adapter (and the base) should decode differently"

"""Start-up warm-up (worker/engine/warm_up.py, `--warmup`): it runs prompts through the real path and
leaves nothing behind, so an engine that warmed up answers exactly like one that did not."""

from __future__ import annotations

import pytest

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

PROMPTS = ["Hello there", "SELECT name FROM users", "A poem about the sea"]


def engine(demo_model, demo_adapters, warmup: bool, **kw) -> LLMEngine:
    config = EngineConfig(max_loras=2, max_cpu_loras=4, num_kv_blocks=128, max_num_batched_tokens=256,
                          warmup=warmup, **kw)
    return LLMEngine(demo_model, config, lora_modules={n: str(p) for n, p in list(demo_adapters.items())[:2]})


@pytest.mark.parametrize("graphs", [False, True])
def test_warm_engine_answers_like_a_cold_one(demo_model, demo_adapters, graphs: bool) -> None:
    warm, cold = (engine(demo_model, demo_adapters, w, cuda_graphs=graphs) for w in (True, False))
    # Nothing of the warm-up remains: requests, KV blocks, prefix-cache entries, counters.
    assert not warm.has_unfinished() and not warm._tracked
    assert warm.blocks.num_free == warm.blocks.num_blocks and not warm.blocks._block_of
    assert warm.blocks.prefix_hits == warm.blocks.prefix_queries == warm.generated_tokens == 0
    stats = warm.registry.stats
    assert stats.gpu_hits == stats.gpu_misses == stats.cpu_hits == stats.cpu_misses == 0
    assert not any(stats.load_seconds.values()) and warm.scheduler.preempted_total == 0
    assert warm.registry.gpu_resident() == cold.registry.gpu_resident() == []  # the adapter it ran went back
    if graphs:  # every bucket's base graph is ready (uncaptured on CPU: the same static-buffer path),
        keys = set(warm.runner.graphs._graphs)
        assert {(b, 0, 0, False) for b in warm.runner.graphs.buckets} <= keys
        assert any(cls > 0 for _, cls, _, _ in keys)  # and the short prompt's adapter ran a LoRA decode step
    names = list(demo_adapters)[:2]
    adapters = [(), ((names[0], 1.0),), ((names[1], 1.0),)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got, want = (e.generate(PROMPTS, sp, adapters) for e in (warm, cold))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert warm.blocks.prefix_hits == 0  # the warm-up's prompts left no cached prefix to hit


@pytest.mark.parametrize("kw", [dict(max_model_len=16), dict(max_model_len=4), dict(num_kv_blocks=1),
                                dict(num_kv_blocks=2, max_model_len=64), dict(max_num_batched_tokens=16)])
def test_warmup_fits_any_engine_that_starts(demo_model, demo_adapters, kw) -> None:
    """Tiny contexts, caches and step budgets: the warm-up leaves out what cannot run, never fails."""
    config = dict(max_loras=2, max_cpu_loras=4, num_kv_blocks=128, max_num_batched_tokens=256, warmup=True)
    e = LLMEngine(demo_model, EngineConfig(**{**config, **kw}),
                  lora_modules={n: str(p) for n, p in list(demo_adapters.items())[:1]})
    assert not e.has_unfinished() and e.blocks.num_free == e.blocks.num_blocks


def test_warmup_is_off_on_cpu_by_default(demo_model, demo_adapters, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self: calls.append(self) or 0.0)
    engine(demo_model, demo_adapters, None)
    assert calls == []
    engine(demo_model, demo_adapters, True)
    assert len(calls) == 1


def test_warm_up_refuses_a_busy_engine(demo_model, demo_adapters) -> None:
    e = engine(demo_model, demo_adapters, False)
    e.add_request("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before any request"):
        e.warm_up()


def test_reset_prefix_cache_needs_idle_blocks() -> None:
    from lorafleet.worker.engine.sequence import Sequence

    bm = BlockManager(8, 4)
    seq = Sequence(seq_id=0, prompt_ids=list(range(9)), sampling=SamplingParams(), adapters=(), cache_salt="", arrival=0.0)
    assert bm.allocate(seq, 9)
    seq.num_computed = 9  # two full blocks computed
    bm.register_full_blocks(seq)
    with pytest.raises(RuntimeError, match="hold blocks"):
        bm.reset_prefix_cache()
    bm.free(seq)
    assert bm._block_of  # freed blocks stay cached (evictable) ...
    bm.reset_prefix_cache()
    assert not bm._block_of and bm.num_free == 8 and sorted(bm._free) == list(range(8))  # ... until reset

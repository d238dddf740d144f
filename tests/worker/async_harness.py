"""Shared by the async scheduling tests: mixed requests over the demo adapters, greedy sampling
parameters, and an engine on the graph path (run uncaptured on CPU), synchronous or async."""

from __future__ import annotations

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

MIXED = [
    ("Hello world", ()),
    ("SELECT name FROM students", (("sql", 1.0),)),
    ("The router sends each request to a worker", (("chat", 1.0),)),
    ("Roses are red", (("poem", 1.0),)),
    ("def add(a, b):", (("code", 1.0),)),
    ("Once upon a time " * 3, ()),
    ("Every institute uses the same printed textbook", (("sql", 0.7), ("poem", 0.5))),
    ("A tenant sends a request", (("legal", 1.0),)),
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _engine(demo_model, modules, asynchronous: bool, **kw) -> LLMEngine:
    config = EngineConfig(**{"max_loras": 6, "max_cpu_loras": 8, "num_kv_blocks": 256, "cuda_graphs": True,
                             "async_scheduling": asynchronous, "warmup": False,
                             "async_admission": True, **kw})  # stats are the test's own
    return LLMEngine(demo_model, config, lora_modules=modules)

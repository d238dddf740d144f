"""Start-up warm-up (`--warmup`, on by default on CUDA): run what the first requests would otherwise
pay for, then forget it.

A long prompt (up to 512 tokens, one step's budget) and a 16-token one, the short one with the
first registered adapter if there is one, go through prefill and a few decode steps on the normal
path (Triton compiles, cuBLAS kernel choice, the allocator's first growth, one LoRA decode graph);
then the sampled draw's and the logit edits' kernels, and the base decode graph of every batch
bucket. A prompt that the model's context or the KV cache cannot take is left out. Afterwards
nothing of it remains: no request, KV block, prefix-cache entry or adapter in a GPU slot, and the
counters the metrics report start at zero (the decode graphs' capture count keeps the warm-up's
captures: they are real).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine.block_manager import BlockManager
from lorafleet.worker.engine.model_runner import ModelRunner
from lorafleet.worker.engine.outputs import RequestOutput
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.lora.registry import AdapterRegistry
from lorafleet.worker.sampling.sampler import warm_up as warm_up_sampling


class WarmedEngine(Protocol):
    """What the warm-up uses of `LLMEngine` (engine.py), which calls it at start-up."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    device: torch.device
    blocks: BlockManager
    registry: AdapterRegistry
    runner: ModelRunner

    def has_unfinished(self) -> bool: ...

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    adapters: Sequence[tuple[str, float]] = ()) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    def forget_history(self) -> None: ...

log = logging.getLogger("lorafleet.engine")


def warm_up(engine: WarmedEngine) -> float:
    """Warm `engine` up before any request -> seconds taken."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up runs before any request")
    t0 = time.perf_counter()
    vocab, bs = engine.model_config.vocab_size, engine.config.block_size
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def fits(n: int) -> bool:
        return (n >= 1 and n + sp.max_tokens <= engine.max_model_len
                and -(-(n + sp.max_tokens) // bs) <= engine.blocks.num_blocks)

    long_len = min(512, engine.config.max_num_batched_tokens, engine.max_model_len - sp.max_tokens,
                   engine.blocks.num_blocks * bs - sp.max_tokens)
    adapter = engine.registry.names()[:1]
    resident = set(engine.registry.gpu_resident())
    prompts = []
    if fits(long_len):
        prompts.append(([(7919 * i + 13) % vocab for i in range(long_len)], ()))
    if fits(16):
        prompts.append(([(104729 * i + 7) % vocab for i in range(16)], tuple((n, 1.0) for n in adapter)))
    for ids, adapters in prompts:
        engine.add_request(ids, sp, adapters)
    while engine.has_unfinished():
        engine.step()
    warm_up_sampling(vocab, engine.device)  # the draw's and the edits' kernels compile now
    engine.runner.logits_processors.warm_up()
    captured = engine.runner.graphs.capture_base() if engine.runner.graphs is not None else 0
    for name in set(engine.registry.gpu_resident()) - resident:
        engine.registry.offload(name)  # GPU slots as before: the first requests load what they use
    engine.forget_history()
    elapsed = time.perf_counter() - t0
    log.info("warm-up: prompts of %s tokens%s, %d decode graphs captured, %.2f s",
             " and ".join(str(len(ids)) for ids, _ in prompts) or "no",
             f" (adapter {adapter[0]})" if adapter and fits(16) else "", captured, elapsed)
    return elapsed

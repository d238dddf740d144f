"""The engine's memory plan: how many KV cache blocks it gets, and where its memory goes.

The KV cache is sized last, after the weights and the adapter slots: `num_kv_blocks` if set;
on CUDA, with vLLM's `gpu_memory_utilization` (`lorafleet worker`'s default, vLLM's 0.92), what this
worker's share of the GPU leaves after its weights, slots and room for the largest step's
activations and the decode graphs; without it (the Python API's default), a fraction
(`kv_cache_memory_fraction`) of the GPU memory then free, less that room; on CPU a fixed number of
tokens (CPU_DEFAULT_KV_TOKENS, in blocks of the configured size: vLLM sizes its CPU cache from
VLLM_CPU_KVCACHE_SPACE instead, which the worker does not read). The plan is logged in the seed
guide's terms (weights, adapter slots, KV blocks) under the engine's logger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.engine.model_runner import SCORE_SLICE
from lorafleet.worker.engine.scheduler import PROMPT_SCORING_CHUNK
from lorafleet.worker.sampling.logits_processors import BYTES_PER_ENTRY as LOGIT_EDIT_BYTES

log = logging.getLogger("lorafleet.engine")

CPU_DEFAULT_KV_TOKENS = 32768
SAMPLED_LOGIT_BYTES = 2 + 4 + 4  # a sampled row's logits in a half type, float32, and probabilities


def free_at_start(device: torch.device) -> int | None:
    """The device's free memory before the engine allocates anything (CUDA only): the baseline that
    `gpu_memory_utilization` measures this worker's own use from, as vLLM does."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def activation_reserve(config: EngineConfig, model: ModelConfig, graph_rows: int = 0) -> int:
    """Bytes kept out of the KV cache on CUDA: activations of the largest step (a few hidden-sized
    buffers per token) and 1 GiB, the logit-edit state of every sequence a step can run
    (worker/sampling/logits_processors.py) and its sampled logits (in the model's dtype, then a float32
    copy and probabilities: ~10 bytes an entry), a step's scored prompt rows (float32 logits,
    scheduler.PROMPT_SCORING_CHUNK of them) with one log-softmax slice's temporaries
    (model_runner.SCORE_SLICE rows, ~9 bytes an entry), and the decode graphs' memory pool, kept
    for good once captured: activations of `graph_rows` rows and their logits (0: no graphs)."""
    reserve = 4 * config.max_num_batched_tokens * model.intermediate_size * 4 + (1 << 30)
    reserve += config.max_num_seqs * model.vocab_size * (LOGIT_EDIT_BYTES + SAMPLED_LOGIT_BYTES)
    reserve += (PROMPT_SCORING_CHUNK * 4 + SCORE_SLICE * 9) * model.vocab_size
    reserve += graph_rows * (4 * model.intermediate_size * 4 + model.vocab_size * (2 + 4))
    return reserve


def plan_kv_blocks(config: EngineConfig, model: ModelConfig, device: torch.device, per_block: int,
                   baseline_free: int | None = None, graph_rows: int = 0) -> int:
    """KV cache blocks of `per_block` bytes (`ModelRunner.kv_bytes_per_block`); `graph_rows`: the
    decode graphs' largest bucket (0 without graphs).

    `gpu_memory_utilization` U is a per-worker share (vLLM's meaning: two workers at 0.45 share a
    GPU): the KV cache gets U x total less what this worker took since `baseline_free` (weights,
    slots) and the activations' room, and never more than is free.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type != "cuda":
        return max(1, CPU_DEFAULT_KV_TOKENS // config.block_size)
    gib = 1 << 30
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_reserve(config, model, graph_rows)
    utilization = config.gpu_memory_utilization
    if utilization is None:
        blocks = int((free - reserve) * config.kv_cache_memory_fraction) // per_block
        if blocks < 1:
            raise ConfigError(
                f"no GPU memory left for the KV cache: {free / gib:.2f} GiB of {total / gib:.2f} GiB free after the "
                f"weights and adapter slots, {reserve / gib:.2f} GiB kept for activations; lower --max-loras or "
                "--max-lora-rank, or free the GPU")
        return blocks
    share = int(total * utilization)
    baseline = free if baseline_free is None else baseline_free
    if share > baseline:
        raise ConfigError(
            f"--gpu-memory-utilization {utilization:g} asks for {share / gib:.2f} GiB of the GPU's {total / gib:.2f} GiB, "
            f"but only {baseline / gib:.2f} GiB were free when this worker started (other processes hold the rest); "
            "lower it or free the GPU")
    used = baseline - free  # this worker's weights and slots (and whatever else it allocated)
    blocks = (min(share - used, free) - reserve) // per_block
    if blocks < 1:
        raise ConfigError(
            f"--gpu-memory-utilization {utilization:g} ({share / gib:.2f} GiB) leaves no room for the KV cache: "
            f"this worker's weights and adapter slots take {used / gib:.2f} GiB and {reserve / gib:.2f} GiB are kept "
            "for activations; raise it, or lower --max-loras or --max-lora-rank")
    return blocks


def memory_plan(config: EngineConfig, weights_bytes: int, slot_bytes: int, adapter_bytes: dict[str, int],
                num_blocks: int, per_block: int) -> dict[str, object]:
    """Where memory goes: weights, adapter slots (allocated at max_lora_rank), each adapter at its
    true rank (what is copied and computed), KV blocks."""
    return {
        "weights_bytes": weights_bytes,
        "lora_slots": config.max_loras,
        "lora_slot_bytes": slot_bytes,  # allocated at max_lora_rank
        "lora_adapter_bytes": adapter_bytes,  # each adapter at its true rank (what is copied and computed)
        "kv_blocks": num_blocks,
        "kv_block_tokens": config.block_size,
        "kv_bytes": num_blocks * per_block,
    }


def log_memory_plan(plan: dict[str, object], config: EngineConfig, device: torch.device, dtype: torch.dtype,
                    lora_backend: str, attention_backend: str, graph_buckets: Sequence[int] | None,
                    adapter_ranks: dict[str, int]) -> None:
    """Log `memory_plan`'s plan; `graph_buckets`: the decode graphs' batch buckets, None if off."""
    mib, gib = 1 << 20, 1 << 30
    num_blocks = plan["kv_blocks"]
    log.info(
        "memory plan on %s (%s): weights %.3f GiB | %d LoRA slots reserved at max rank %d: %.3f GiB "
        "(%.1f MiB each; kernels read each adapter at its own rank) | KV cache %d blocks x %d tokens = %d tokens, "
        "%.3f GiB | LoRA backend %s, attention backend %s, CUDA graphs %s",
        device, str(dtype).removeprefix("torch."), plan["weights_bytes"] / gib, config.max_loras,
        config.max_lora_rank, plan["lora_slot_bytes"] / gib, plan["lora_slot_bytes"] / config.max_loras / mib,
        num_blocks, config.block_size, num_blocks * config.block_size, plan["kv_bytes"] / gib,
        lora_backend, attention_backend,
        "off" if graph_buckets is None else f"buckets {list(graph_buckets)}" + (
            f" (decode steps of more sequences run eagerly, up to --max-num-seqs {config.max_num_seqs})"
            if config.max_num_seqs > graph_buckets[-1] else ""),
    )
    for name, nbytes in plan["lora_adapter_bytes"].items():
        log.info("adapter %s: rank %d, %.2f MiB at its rank", name, adapter_ranks[name], nbytes / mib)

"""The kernel benchmark's cases and their inputs: seed shapes, the case table, weights and metadata.

For the seed model shape (hidden 4096, kv 1024, mlp 14336; modules qkv, o, gate_up, down), bf16,
rank 16, tokens in {1, 16, 64, 256}, distinct adapters in {1, 8, 64, 128} (never more than tokens),
plus rank 8 in a rank-64 pool vs a rank-8 pool (B rank-major as the slot pool stores it, and a few
rows out-major), and k = 2 adapters per token. The meta's rank bound is the case's true rank, as
the engine sets it from the step's slots.

Each case's inputs come in `n_sets` copies (together at least `L2_FLUSH_BYTES`, up to 32), which the
timing rotates through so successive calls do not hit in L2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bench.graph_timing import DEVICE, L2_FLUSH_BYTES
from lorafleet.kernels.lora.meta import LoraMeta, build_lora_meta
from lorafleet.kernels.lora.operands import new_lora_b
from lorafleet.worker.engine.cuda_graphs import chunk_class

HIDDEN, KV, MLP = 4096, 1024, 14336
MODULES: dict[str, tuple[int, list[int]]] = {
    "qkv": (HIDDEN, [HIDDEN, KV, KV]),
    "o": (HIDDEN, [HIDDEN]),
    "gate_up": (HIDDEN, [MLP, MLP]),
    "down": (MLP, [HIDDEN]),
}
DTYPE = torch.bfloat16
BYTES = 2


@dataclass(frozen=True, slots=True)
class Case:
    module: str
    tokens: int
    adapters: int
    rank: int
    pool_rank: int
    k: int = 1
    b_layout: str = "rank_major"  # as worker/lora/slots.py stores B; "out_major" = contiguous [S, out, r]


def main_cases(quick: bool) -> list[Case]:
    tokens_list = [1, 16, 64, 256]
    adapters_list = [1, 8, 64, 128]
    cases = []
    for module in MODULES:
        for tokens in tokens_list:
            for adapters in adapters_list:
                if adapters <= tokens:
                    cases.append(Case(module, tokens, adapters, 16, 16))
        for tokens, adapters in [(64, 8), (64, 64), (256, 64)]:
            cases.append(Case(module, tokens, adapters, 8, 8))
            cases.append(Case(module, tokens, adapters, 8, 64))
            if tokens == 64:
                cases.append(Case(module, tokens, adapters, 8, 64, b_layout="out_major"))
            cases.append(Case(module, tokens, adapters, 16, 16, k=2))
    if quick:
        cases = [c for c in cases if c.tokens in (16, 64) and c.module in ("qkv", "down")]
    return cases


@dataclass(slots=True)
class Inputs:
    x: torch.Tensor  # [T, in]
    y: torch.Tensor  # [T, Σout]
    lora_a: list[torch.Tensor]  # [S, pool_rank, in] per slice
    lora_b: list[torch.Tensor]  # [S, out_s, pool_rank] per slice


def make_case_inputs(
    case: Case, g: torch.Generator
) -> tuple[list[Inputs], torch.Tensor, torch.Tensor, list[list[int]]]:
    d_in, outs = MODULES[case.module]
    slots = case.adapters
    active_bytes = adapter_bytes(case)
    act_bytes = case.tokens * (d_in + sum(outs)) * BYTES
    n_sets = max(2, min(32, math.ceil(L2_FLUSH_BYTES / (active_bytes + act_bytes))))
    sets = []
    for _ in range(n_sets):
        lora_a = [
            torch.randn(slots, case.pool_rank, d_in, device=DEVICE, dtype=DTYPE) / d_in**0.5 for _ in outs
        ]
        lora_b = [
            torch.randn(slots, o, case.pool_rank, device=DEVICE, dtype=DTYPE) / case.rank**0.5 for o in outs
        ]
        if case.b_layout == "rank_major":
            lora_b = [store_rank_major(b) for b in lora_b]
        x = torch.randn(case.tokens, d_in, device=DEVICE, dtype=DTYPE)
        y = torch.randn(case.tokens, sum(outs), device=DEVICE, dtype=DTYPE)
        sets.append(Inputs(x, y, lora_a, lora_b))
    token_slots = case_token_slots(case)
    token_scales = torch.rand(case.tokens, case.k, generator=g) + 0.5
    ranks = [[case.rank] * slots for _ in outs]
    return sets, token_slots, token_scales, ranks


def case_token_slots(case: Case) -> torch.Tensor:
    """`[T, k]` int32: each of the `adapters` slots gets tokens / adapters tokens; with k = 2 a
    token's second adapter is the next slot, so every adapter appears in both entry columns."""
    t = torch.arange(case.tokens)
    first = (t * case.adapters) // case.tokens
    return torch.stack([(first + j) % case.adapters for j in range(case.k)], 1).to(torch.int32)


def case_meta(
    case: Case, token_slots: torch.Tensor, token_scales: torch.Tensor, chunk_size: int | None = None
) -> LoraMeta:
    """The case's step metadata as the engine launches it (chunk_size: None = `default_chunk_size`)."""
    meta = build_lora_meta(token_slots, token_scales, case.adapters, DEVICE, chunk_size=chunk_size)
    meta.rank_bound = case.rank  # as ModelRunner sets it: the step's largest true rank
    meta.launch_chunks = chunk_class(meta.num_chunks, meta.max_chunks)  # as a decode graph launches
    return meta


def parse_cases(text: str, rank: int = 16) -> list[Case]:
    """"MODULE:TOKENS:ADAPTERS,..." -> rank-`rank` cases in a pool of that rank."""
    cases = []
    for spec in text.split(","):
        module, tokens, adapters = spec.split(":")
        cases.append(Case(module, int(tokens), int(adapters), rank, rank))
    return cases


def adapter_bytes(case: Case) -> int:
    """Each distinct adapter's A (one per slice) and B, at its true rank."""
    d_in, outs = MODULES[case.module]
    return case.adapters * case.rank * (len(outs) * d_in + sum(outs)) * BYTES


def store_rank_major(b: torch.Tensor) -> torch.Tensor:
    """The same values in the slot pool's layout (`new_lora_b`: rank-major memory)."""
    stored = new_lora_b(b.shape[0], b.shape[1], b.shape[2], device=b.device, dtype=b.dtype)
    stored.copy_(b)
    return stored

"""Fixtures of the bench scripts' tests: `bench` importable, and slot stacks to read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafleet.kernels.lora.operands import new_lora_b

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_importable(tmp_path, monkeypatch) -> None:
    """`import bench` works: the folder linked alone onto sys.path (the repo root itself would shadow
    the stdlib's operator)."""
    (tmp_path / "bench").symlink_to(ROOT / "bench")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def positive_stacks():
    """(A per slice `[S, r_max, in]`, B per slice rank-major as the slot pool stores it) with every
    value in [1, 2): a read that misses a row, or takes one too many, changes a sum."""

    def make(g: torch.Generator, slots: int, r_max: int, in_f: int, outs: list[int]):
        a = [torch.rand(slots, r_max, in_f, generator=g) + 1 for _ in outs]
        b = []
        for out in outs:
            t = new_lora_b(slots, out, r_max, device="cpu", dtype=torch.float32)
            t.copy_(torch.rand(slots, out, r_max, generator=g) + 1)
            b.append(t)
        return a, b

    return make

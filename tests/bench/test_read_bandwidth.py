"""bench/read_bandwidth.py: the streaming-read kernel reads every element once (under the
interpreter, odd sizes: a partial last block, a program past the end of several blocks), so the
bandwidth it reports is for bytes that were really read."""

from __future__ import annotations

import os

import pytest
import torch
import triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter")


@pytest.mark.parametrize("n,block,iters", [(1, 16, 1), (1000, 64, 4), (4099, 128, 2), (512, 128, 4)])
def test_read_kernel_sums_every_element_once(bench_importable, n: int, block: int, iters: int) -> None:
    from bench.read_bandwidth import triton_read

    x = (torch.arange(n, dtype=torch.float32) % 97 + 1).to(torch.bfloat16)  # exact in bf16, no zeros
    out = torch.full((triton.cdiv(n, block * iters),), float("nan"))
    triton_read(x, out, block, iters)
    assert out.sum().item() == x.float().sum().item()
    ones = torch.ones(n, dtype=torch.bfloat16)
    triton_read(ones, out, block, iters)
    # each program's count: what a block of `block * iters` elements from its start holds
    want = [min(block * iters, n - p * block * iters) for p in range(out.numel())]
    assert out.tolist() == [float(w) for w in want]

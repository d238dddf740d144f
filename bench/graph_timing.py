"""The kernel benchmarks' timing harness: CUDA-graph replay timing and the copy-bandwidth yardstick.

An op is captured in a CUDA graph (as the engine's decode step will be) that runs it over `n_sets`
copies of the weights and activations in turn (together at least `L2_FLUSH_BYTES`), so successive
calls do not hit in L2; `triton.testing.do_bench` (which also clears L2 before each replay) gives
the median replay time, divided by the number of calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from triton.testing import do_bench

L2_FLUSH_BYTES = 256 * 2**20  # rotate through at least this much per graph replay
DEVICE = "cuda"


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    n = 2**30 // 4
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3)


def time_graph(calls: list[Callable[[], None]]) -> float:
    """Median µs per call of `calls`, captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:  # warm up: compile kernels, allocate workspaces
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = do_bench(graph.replay, warmup=25, rep=150, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def copy_us(nbytes: float) -> float:
    """µs of one device-to-device copy moving `nbytes` (half read, half written), timed as the
    kernels are: in a CUDA graph over up to 32 buffer pairs (≥ 256 MiB where that cap allows, as
    the kernels' `n_sets`), so successive copies miss L2 except for the smallest sizes."""
    n = max(1, int(nbytes // 8))  # float32 elements each side
    pairs = [(torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE))
             for _ in range(max(2, min(32, math.ceil(L2_FLUSH_BYTES / (8 * n)))))]
    return time_graph([lambda d=d, src=src: d.copy_(src) for d, src in pairs])

"""How fast the GPU reads memory, beside the copy bandwidth the benchmarks' floors and ceilings use.

    python -m bench.read_bandwidth [--gib 1] [--out bench/results/read-bandwidth-h200.json]

A decode step mostly reads (weights, adapters, KV), while `bench/kernels.py` and `bench/engine.py`
measure a device-to-device copy (as many bytes written as read). This times, on one buffer:
  copy          `dst.copy_(src)`, bytes read + written (the benchmarks' figure);
  torch sum     `x.sum(dtype=float32)`: bytes read;
  triton read   a streaming kernel that reads every byte once (16-byte vectors, a program per
                block, one float per program written): bytes read.
Medians of `triton.testing.do_bench`; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in tl.static_range(ITERS):  # all of a program's loads issued before any is summed
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def triton_read(x: torch.Tensor, out: torch.Tensor, block: int, iters: int) -> None:
    _read_kernel[(triton.cdiv(x.numel(), block * iters),)](x, out, x.numel(), BLOCK=block, ITERS=iters,
                                                            num_warps=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/read-bandwidth-h200.json"))
    args = ap.parse_args()
    n = int(args.gib * 2**30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    rows = []

    def timed(name: str, fn, nbytes: int) -> None:
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append({"case": name, "ms": round(ms, 4), "bytes": nbytes, "tb_s": round(nbytes / ms / 1e9, 3)})
        print(f"{name:28s} {ms * 1e3:9.1f} µs  {nbytes / ms / 1e9:6.3f} TB/s", flush=True)

    timed("copy (read + write)", lambda: dst.copy_(x), 2 * x.nbytes)
    timed("torch sum (read)", lambda: x.sum(dtype=torch.float32), x.nbytes)
    want = x.float().sum().item()
    for block, iters in ((2048, 4), (4096, 4), (2048, 8), (8192, 2)):
        out = torch.empty(triton.cdiv(n, block * iters), device="cuda", dtype=torch.float32)
        triton_read(x, out, block, iters)
        assert abs(out.sum().item() - want) <= 1e-3 * (abs(want) + x.numel() ** 0.5), "read kernel disagrees"
        timed(f"triton read {block}x{iters}", lambda b=block, i=iters, o=out: triton_read(x, o, b, i), x.nbytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                                    "gib": args.gib, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

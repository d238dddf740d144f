"""Greedy decoding's pick in one read of the logits: each row's argmax and whether the row is finite.

    greedy_pick(logits) -> (tokens, shown)          # logits [N, vocab]: float16, bfloat16, float32
        tokens[i] = the first index of row i's largest value, NaN counted as -inf
                    (0 for a row that is all NaN / -inf): always a valid vocabulary index
        shown[i]  = tokens[i] if every value of row i is finite, else -1

`shown` is what the host reads (sampling.SampledTokens: -1 ends that request with an error, an
overflow in half precision); `tokens` can feed the next step on the device whatever the row held.
For rows without NaN, `tokens` is `torch.argmax` of the row (ties: the first index, as torch).
Sampling's own check (a row's float32 sum not finite) also flags a row of finite values whose sum
overflows (each above ~1e33); the pick does not, and gives it its argmax.

Torch takes three passes for this over float32 logits (the conversion from the lm_head's bf16, a
row sum for finiteness, the argmax: tens of µs a decode step at batch 64 and vocab 100,000;
docs/benchmarks.md, "Sampling without a sort"). The kernel reads the bf16 logits once: each (row, split) program
reduces its range to (max, first index, any non-finite), and a second launch, one program a row,
reduces the splits (`greedy_triton.py`). Both launches' grids follow from the shape alone, so the
decode graphs capture them (worker/engine/cuda_graphs.py). `greedy_pick_reference` is the torch oracle and
the path without Triton.
"""

from __future__ import annotations

import torch

NO_INDEX = torch.iinfo(torch.int32).max  # "no element" in the kernels: larger than any vocabulary index


def greedy_pick(logits: torch.Tensor, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, shown), int64 `[N]` each, on the logits' device (module docstring); backend
    "triton" runs the one-read kernels of `greedy_triton`, "torch" the reference."""
    check_logits(logits)
    if backend == "triton":
        from lorafleet.kernels.sampling.greedy_triton import greedy_pick_triton

        return greedy_pick_triton(logits)
    if backend != "torch":
        raise ValueError(f"backend must be torch|triton, got {backend!r}")
    return greedy_pick_reference(logits)


def check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be a float16/bfloat16/float32 [N, vocab] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError("logits need a vocabulary of at least one entry, with unit stride")
    if logits.shape[1] >= NO_INDEX:
        raise ValueError(f"vocabulary of {logits.shape[1]} does not fit int32 indices")


def greedy_pick_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch (the oracle, and the path without Triton)."""
    tokens = logits.masked_fill(logits.isnan(), float("-inf")).argmax(dim=-1)
    finite = logits.isfinite().all(dim=-1)
    return tokens, torch.where(finite, tokens, -1)

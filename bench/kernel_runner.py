"""One row of the kernel benchmark: a case's LoRA op timed and checked, against its floor and baselines.

- lora_us: `add_lora(..., backend="triton")`: the split-K shrink + expand with `pick_config`,
  the expand launched with programmatic dependent launch where supported (`pdl`);
  no_pdl_us: the same without it.
- floor_us: bytes the op must move (each distinct adapter's A of every slice and B at its true rank,
  x read once, y read and written once) over the device-to-device copy bandwidth measured in this
  run (a 1 GiB copy).
- copy_us: a device-to-device copy that moves the same bytes (half read, half written; torch's
  copy kernel, one launch), timed as the op is: what moving that many bytes costs at all at this
  size, launch and ramp included.
- gather_us: torch gather-bmm (each token gathers its own A and B, padded to the pool rank).
- loop_us: per-adapter torch loop (one bf16 matmul pair per segment and slice, index_add into y).
- base_us: the base GEMM x @ W.T for the same module.
  (`baselines=False` skips gather/loop/base: they take most of the run time.)

Each is timed with `bench/graph_timing.py`'s `time_graph` over the case's `n_sets` input copies.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from bench.graph_timing import DEVICE, L2_FLUSH_BYTES, copy_us, time_graph
from bench.kernel_cases import (
    BYTES,
    DTYPE,
    MODULES,
    Case,
    Inputs,
    adapter_bytes,
    case_meta,
    make_case_inputs,
)
from lorafleet.kernels.lora.config import LoraKernelConfig
from lorafleet.kernels.lora.launch import add_lora_triton
from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.lora.ops import add_lora
from lorafleet.kernels.pdl import pdl_supported


def gather_bmm(inp: Inputs, slots_dev: torch.Tensor, scales_dev: torch.Tensor) -> None:
    """Each token gathers its adapter's (pool-padded) A and B, then two batched matvecs."""
    col = 0
    safe = slots_dev.clamp_min(0).long()  # [T, k]
    weight = torch.where(slots_dev >= 0, scales_dev, 0).to(DTYPE)  # [T, k]
    for a, b in zip(inp.lora_a, inp.lora_b, strict=True):
        out = b.shape[1]
        for j in range(safe.shape[1]):
            h = torch.bmm(a[safe[:, j]], inp.x.unsqueeze(2))  # [T, r, 1]
            h = h * weight[:, j, None, None]
            inp.y[:, col : col + out] += torch.bmm(b[safe[:, j]], h).squeeze(2)  # [T, out]
        col += out


def segment_loop(inp: Inputs, meta: LoraMeta, ranks: list[list[int]]) -> None:
    """One bf16 matmul pair per (adapter segment, slice), added with index_add_."""
    for slot, start, end in meta.segments:
        rows = meta.sorted_token[start:end].long()
        scale = meta.sorted_scale[start:end].to(DTYPE).unsqueeze(1)
        xs = inp.x.index_select(0, rows)
        col = 0
        for a, b, slice_ranks in zip(inp.lora_a, inp.lora_b, ranks, strict=True):
            out, r = b.shape[1], slice_ranks[slot]
            inp.y[:, col : col + out].index_add_(0, rows, ((xs @ a[slot, :r].T) * scale) @ b[slot, :, :r].T)
            col += out


def check_and_time(
    sets: list[Inputs],
    ranks: list[list[int]],
    ranks_dev: torch.Tensor,
    meta: LoraMeta,
    config: LoraKernelConfig | None,
    pdl: bool | None = None,
) -> tuple[float, float]:
    """(µs per call, ‖Δtriton − Δref‖ / ‖Δref‖ on the first set) of `add_lora_triton`.

    Every set's y is restored afterwards (timing adds the delta into it thousands of times), so
    the next call's error is measured on the original values.
    """
    inp = sets[0]
    saved = [s.y.clone() for s in sets]
    y0 = inp.y.clone()
    ref = inp.y.clone()
    add_lora(ref, inp.x, inp.lora_a, inp.lora_b, ranks, ranks_dev, meta, backend="torch")
    add_lora_triton(inp.y, inp.x, inp.lora_a, inp.lora_b, ranks_dev, meta, config=config, pdl=pdl)
    d_ref, d_tri = (ref.double() - y0.double()), (inp.y.double() - y0.double())
    rel_err = float((d_tri - d_ref).norm() / d_ref.norm())
    inp.y.copy_(y0)
    us = time_graph(
        [
            lambda s=s: add_lora_triton(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta, config=config, pdl=pdl)
            for s in sets
        ]
    )
    for s, y in zip(sets, saved, strict=True):
        s.y.copy_(y)
    return us, rel_err


def run_case(
    case: Case,
    bandwidth: float,
    g: torch.Generator,
    config: LoraKernelConfig | None = None,
    baselines: bool = True,
    chunk_size: int | None = None,
) -> dict:
    d_in, outs = MODULES[case.module]
    sets, token_slots, token_scales, ranks = make_case_inputs(case, g)
    meta = case_meta(case, token_slots, token_scales, chunk_size)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    row = dict(asdict(case))
    act_bytes = case.tokens * (d_in + 2 * sum(outs)) * BYTES
    row.update(floor_us=round((adapter_bytes(case) + act_bytes) / bandwidth * 1e6, 2), n_sets=len(sets),
               chunk_size=meta.chunk_size)
    if config is None:  # the table's rows (a sweep compares configs only)
        row["copy_us"] = round(copy_us(adapter_bytes(case) + act_bytes), 2)
    us, err = check_and_time(sets, ranks, ranks_dev, meta, config)
    row.update(lora_us=round(us, 2), rel_err=float(f"{err:.2e}"), pdl=pdl_supported(torch.cuda.current_device()))
    if config is not None:
        return row
    if row["pdl"]:
        us, err = check_and_time(sets, ranks, ranks_dev, meta, config, pdl=False)
        row.update(no_pdl_us=round(us, 2), rel_err=max(row["rel_err"], float(f"{err:.2e}")))
    if not baselines:
        row.update(gather_us=None, loop_us=None, base_us=None)
        return row
    slots_dev, scales_dev = meta.token_slots, meta.token_scales
    row["gather_us"] = round(time_graph([lambda s=s: gather_bmm(s, slots_dev, scales_dev) for s in sets]), 2)
    row["loop_us"] = round(time_graph([lambda s=s: segment_loop(s, meta, ranks) for s in sets]), 2)
    row["base_us"] = base_gemm_us(case.module, case.tokens)
    return row


_BASE_CACHE: dict[tuple[str, int], float] = {}


def base_gemm_us(module: str, tokens: int) -> float:
    key = (module, tokens)
    if key not in _BASE_CACHE:
        d_in, outs = MODULES[module]
        n_w = max(2, math.ceil(L2_FLUSH_BYTES / (d_in * sum(outs) * BYTES)))
        ws = [torch.randn(sum(outs), d_in, device=DEVICE, dtype=DTYPE) for _ in range(n_w)]
        xs = [torch.randn(tokens, d_in, device=DEVICE, dtype=DTYPE) for _ in range(n_w)]
        _BASE_CACHE[key] = round(
            time_graph([lambda w=w, x=x: torch.mm(x, w.T) for w, x in zip(ws, xs, strict=True)]), 2
        )
    return _BASE_CACHE[key]

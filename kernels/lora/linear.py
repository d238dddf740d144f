"""A base projection with its LoRA side path (`linear_lora_deferred`): beside the base GEMM or after it.

With the Triton backend, a side stream and few enough chunks, the side path (shrink, expand into
a delta) runs on that stream while the base GEMM runs, a decode-sized GEMM leaving SMs free for it
(`gemm_sm_carveout`), and the caller adds the delta where it reads y anyway; otherwise the LoRA is
added into y after the GEMM (`add_lora`). `SidePath` chooses where and how: the process's from the
LORAFLEET_* settings (kernels/envs.py), or one passed in.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lorafleet.kernels import envs
from lorafleet.kernels.lora.meta import LoraMeta
from lorafleet.kernels.lora.ops import add_lora

# The side path runs beside the GEMM up to `overlap_max_chunks` chunks (default: always), and a
# decode-sized GEMM beside it (at most CARVEOUT_MAX_TOKENS rows: memory-bound, so it keeps its
# bandwidth on fewer SMs) leaves SMs free for the LoRA kernels (cuBLASLt's SM count target; cuBLAS
# ignores it): `carveout[0]` for a launch of at most `few_chunks` chunks, [1] above, beside a GEMM
# under LARGE_GEMM_ELEMENTS weight elements; [2] and [3] likewise beside a larger one; without a
# carveout the LoRA kernels wait for the GEMM's last CTAs. With one adapter per token the expand
# stores the delta (`delta_store`: nothing zeroes it); otherwise, above `few_chunks` the shrink's
# programs zero it instead of a memset launch before them (`zero_in_shrink`). Above `few_chunks` the
# side path runs beside only decode-sized GEMMs (prefill steps with many chunks keep it after the GEMM,
# where it is measured). Carveouts are capped at CARVEOUT_MAX_SHARE of the GPU's SMs. The measurements
# behind each default: docs/benchmarks.md, "LoRA side path".


@dataclass(frozen=True, slots=True)
class SidePath:
    """Where and how `linear_lora_deferred` runs the LoRA side path; pairs are (at most, above)
    `few_chunks` chunks. `SIDE_PATH` is the process's, from the LORAFLEET_* settings (kernels/envs.py)."""

    overlap_max_chunks: int
    few_chunks: int
    carveout: tuple[int, int, int, int]  # (few small, many small, few large, many large)
    # The GEMM launched before the LoRA kernels beside it: LoRA kernels launched first fill every SM
    # with their programs and the GEMM's CTAs wait for them to drain; a GEMM launched first takes its
    # SMs and leaves the carveout to the LoRA.
    gemm_first: tuple[bool, bool]
    zero_in_shrink: bool  # above few_chunks, unless the expand stores (False: a memset)
    # With one adapter per token, the expand stores the delta (no memset or zeroing shrink before it,
    # no read of it; its reader masks the rows of tokens without an adapter with LoraMeta.has_lora).
    delta_store: tuple[bool, bool]


def _carveouts(text: str) -> tuple[int, int, int, int]:
    """LORAFLEET_GEMM_SM_CARVEOUT: SMs for (few, many) chunks beside a small GEMM, then beside a
    large one (LARGE_GEMM_ELEMENTS): "a,b,c,d"; "few,many" ("32,48") for both sizes; or one number
    ("48")."""
    try:
        parts = [int(v) for v in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2, 4) or min(parts) < 0:
        raise ValueError(f"LORAFLEET_GEMM_SM_CARVEOUT must be N, N,M or A,B,C,D (SMs >= 0), got {text!r}")
    return carveout_table(parts)


def carveout_table(parts: Sequence[int]) -> tuple[int, int, int, int]:
    """1, 2 or 4 carveouts -> (few small, many small, few large, many large)."""
    if len(parts) == 1:
        return (parts[0],) * 4
    if len(parts) == 2:
        return parts[0], parts[1], parts[0], parts[1]
    if len(parts) == 4:
        return tuple(parts)
    raise ValueError(f"1, 2 or 4 carveouts, got {len(parts)}")


def _pair(name: str, text: str) -> tuple[bool, bool]:
    """LORAFLEET_GEMM_FIRST / LORAFLEET_DELTA_STORE: "few,many" of 0/1, or one value for both."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (1, 2) or any(p not in ("0", "1") for p in parts):
        raise ValueError(f"{name} must be 0, 1 or two of them (few,many chunks), got {text!r}")
    return (parts[0] == "1", parts[-1] == "1")


def side_path_from_env() -> SidePath:
    """The side path the LORAFLEET_* settings read at start-up (kernels/envs.py) describe."""
    if envs.LORA_FEW_CHUNKS < 0:
        raise ValueError(f"LORAFLEET_LORA_FEW_CHUNKS must be >= 0, got {envs.LORA_FEW_CHUNKS}")
    return SidePath(
        overlap_max_chunks=envs.OVERLAP_MAX_CHUNKS, few_chunks=envs.LORA_FEW_CHUNKS,
        carveout=_carveouts(envs.GEMM_SM_CARVEOUT), gemm_first=_pair("LORAFLEET_GEMM_FIRST", envs.GEMM_FIRST),
        zero_in_shrink=envs.ZERO_IN_SHRINK, delta_store=_pair("LORAFLEET_DELTA_STORE", envs.DELTA_STORE),
    )


SIDE_PATH = side_path_from_env()
CARVEOUT_MAX_SHARE = 5 / 8  # of the GPU's SMs; the rest stay with the GEMM (82 of the H200's 132)
LARGE_GEMM_ELEMENTS = 1 << 25  # weight elements: at the seed shape gate_up and down are large, qkv and o small
CARVEOUT_MAX_TOKENS = 128


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _carveout(side: SidePath, device: torch.device, many: bool, large: bool) -> int:
    """side.carveout (tuned on the H200's 132 SMs), at most CARVEOUT_MAX_SHARE of this GPU's
    SMs: a smaller GPU keeps most of its SMs for the GEMM."""
    return min(side.carveout[2 * large + many], int(_sm_count(device) * CARVEOUT_MAX_SHARE))


@contextlib.contextmanager
def gemm_sm_carveout(sms: int) -> Iterator[None]:
    """cuBLASLt GEMMs issued inside leave `sms` SMs free for kernels on other streams (no-op for 0
    or where torch lacks the setting). A captured graph keeps the GEMM kernel chosen then."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if sms <= 0 or setter is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    setter(sms)
    try:
        yield
    finally:
        setter(before)


def linear_lora_deferred(
    base: Callable[[], torch.Tensor],
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    ranks: Sequence[Sequence[int]],
    ranks_device: torch.Tensor | None,
    meta: LoraMeta,
    backend: str = "torch",
    side_stream: torch.cuda.Stream | None = None,
    side_path: SidePath | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`base()` (the base projection of x) and the LoRA side path -> (y, delta).

    With the Triton backend, a side stream and at most `overlap_max_chunks` chunks to launch for
    (above `few_chunks`, decode-sized steps only), the whole side path runs on the side stream while
    the base GEMM runs: zero a delta buffer (a memset, or the shrink's programs above `few_chunks`),
    shrink, expand into the delta. The current stream waits for the side stream before
    returning, and the caller adds the delta where it reads y anyway (the fused row kernels'
    `delta` argument), so in a decode step the small, latency-bound LoRA launches hide behind the
    GEMM's weight reads instead of following it. A decode-sized GEMM leaves `carveout` SMs
    to them (a GEMM that fills every SM makes them wait for its last CTAs). CUDA-graph capture
    records the fork and the join as graph edges.
    Not beside the GEMM (another backend, no side stream, too many chunks), the LoRA is added into
    y in place and delta is None.
    With one adapter per token (and `delta_store`) the expand stores into the delta instead of adding
    into a zeroed one: nothing zeroes it, and its rows of tokens without an adapter are left
    undefined, so the reader masks them with `meta.has_lora` (the fused row kernels' `delta_rows`).
    side_path: these settings (default: the process's, SIDE_PATH).
    """
    side = SIDE_PATH if side_path is None else side_path
    beside = meta.grid_chunks <= side.overlap_max_chunks and (
        meta.grid_chunks <= side.few_chunks or x.shape[0] <= CARVEOUT_MAX_TOKENS)  # many chunks: decode steps only
    if backend != "triton" or side_stream is None or not beside:
        y = base()
        add_lora(y, x, lora_a, lora_b, ranks, ranks_device, meta, backend)
        return y, None
    from lorafleet.kernels.lora.launch import launch_expand, launch_shrink, plan_lora_triton

    plan = plan_lora_triton(x, lora_a, lora_b, ranks_device, meta)
    if plan is None:
        return base(), None
    # Allocated on the current stream, so the caching allocator never hands these buffers to the
    # side stream's next request while the current stream still reads them.
    delta = torch.empty((x.shape[0], sum(b.shape[1] for b in lora_b)), dtype=x.dtype, device=x.device)
    main = torch.cuda.current_stream(x.device)
    many = meta.grid_chunks > side.few_chunks
    large = x.shape[1] * delta.shape[1] >= LARGE_GEMM_ELEMENTS
    carveout = _carveout(side, x.device, many, large) if x.shape[0] <= CARVEOUT_MAX_TOKENS else 0
    gemm_first = side.gemm_first[many]
    inputs_ready = torch.cuda.Event()
    inputs_ready.record(main)
    side_stream.wait_event(inputs_ready)  # x, not the GEMM; before the try, so the join is well-formed
    y = None
    try:
        if gemm_first:  # launched (and, in a graph, made a node) first: its CTAs are placed before the LoRA's
            with gemm_sm_carveout(carveout):
                y = base()
        with torch.cuda.stream(side_stream):
            store = side.delta_store[many] and meta.token_slots.shape[1] == 1 and meta.has_lora is not None
            zero_in_shrink = side.zero_in_shrink and many and not store
            if not (store or zero_in_shrink):
                delta.zero_()
            launch_shrink(plan, zero=delta if zero_in_shrink else None)
            launch_expand(plan, delta, store)  # programmatic dependent launch after the shrink where supported
        if not gemm_first:
            with gemm_sm_carveout(carveout):
                y = base()
    finally:  # joined even when a launch or the GEMM raises: the buffers must not be reused early
        main.wait_stream(side_stream)
    return y, delta


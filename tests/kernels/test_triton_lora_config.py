"""Triton LoRA launch parameters: `pick_config`'s row-at-a-time modes, the checks of
`LoraKernelConfig`, and the plan's check of a meta's launch bound on chunks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lorafleet.kernels.lora.config import LoraKernelConfig
from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.kernels.lora.tuning import active_tuning
from tests.kernels.lora_cases import DEVICE, make_weights


def test_pick_config_runs_the_shrink_a_row_at_a_time_only_where_asked() -> None:
    """tuning.shrink_rows: for a step of one-pair chunks, decode-sized only, with its K tile and warps;
    never while it is empty."""
    from lorafleet.kernels.lora import config as lora_config

    cfg = lora_config.pick_config(64, 3, 4096, 16, one_pair=True)
    assert (cfg.shrink_rows, cfg.block_k, cfg.shrink_warps) == (True, *active_tuning().shrink_rows)
    assert not lora_config.pick_config(64, 3, 4096, 16).shrink_rows  # chunks of several pairs
    assert not lora_config.pick_config(64, 3, 4096, 64, one_pair=True).shrink_rows  # prefill chunks
    never = replace(active_tuning(), shrink_rows=())
    assert not lora_config.pick_config(64, 3, 4096, 16, one_pair=True, tuning=never).shrink_rows


def test_pick_config_runs_the_expand_a_row_at_a_time_only_where_asked() -> None:
    """tuning.expand_rows: likewise, one B tile of its width a program, with its warps."""
    from lorafleet.kernels.lora import config as lora_config

    t = replace(active_tuning(), expand_rows=(256, 8))
    cfg = lora_config.pick_config(64, 3, 4096, 16, one_pair=True, tuning=t)
    assert (cfg.expand_rows, cfg.block_n, cfg.n_per_prog, cfg.expand_warps) == (True, 256, 256, 8)
    assert cfg.expand_maxnreg is None  # no register cap unless expand_rows names one
    t = replace(t, expand_rows=(256, 8, 168))
    assert lora_config.pick_config(64, 3, 4096, 16, one_pair=True, tuning=t).expand_maxnreg == 168
    assert lora_config.pick_config(64, 3, 4096, 16, tuning=t).expand_maxnreg is None  # the tl.dot expand: never
    assert not lora_config.pick_config(64, 3, 4096, 16, tuning=t).expand_rows  # chunks of several pairs
    assert not lora_config.pick_config(64, 3, 4096, 64, one_pair=True, tuning=t).expand_rows  # prefill chunks
    t = replace(t, expand_rows=())
    assert not lora_config.pick_config(64, 3, 4096, 16, one_pair=True, tuning=t).expand_rows


def test_pick_config_loads_the_next_expand_tile_ahead_only_where_asked() -> None:
    """tuning.expand_ahead: for programs of several tl.dot tiles of at most 16 rows, with few chunks (by
    default) or many."""
    from lorafleet.kernels.lora import config as lora_config

    assert lora_config.pick_config(8, 3, 4096, 16).expand_ahead  # 8 adapters' decode: 256 columns, 128 a tile
    assert not lora_config.pick_config(16, 2, 4096, 64).expand_ahead  # chunks of 64 rows (prefill)
    assert not lora_config.pick_config(4, 3, 4096, 16).expand_ahead  # one tile a program
    one_tile = lora_config.pick_config(4, 3, 4096, 16)  # ... but a sweep giving it two tiles gets the lookahead
    assert lora_config.with_expand_tiles(one_tile, 4, 16, 256, 128).expand_ahead
    assert not lora_config.with_expand_tiles(one_tile, 4, 16, 128, 128).expand_ahead
    rows = lora_config.pick_config(64, 3, 4096, 16, one_pair=True)  # a sweep's tl.dot tiles for a row-expand step
    assert rows.expand_rows and not lora_config.with_expand_tiles(rows, 64, 16, 256, 128).expand_rows
    assert not lora_config.pick_config(64, 3, 4096, 16).expand_ahead  # many chunks
    many = replace(active_tuning(), expand_ahead=(False, True))
    assert not lora_config.pick_config(8, 3, 4096, 16, tuning=many).expand_ahead
    assert lora_config.pick_config(64, 3, 4096, 16, tuning=many).expand_ahead
    assert not lora_config.pick_config(64, 3, 4096, 16, one_pair=True, tuning=many).expand_ahead  # the row expand: never


@pytest.mark.parametrize("bad,says", [
    (dict(block_k=8), "block_k must be a power of two >= 16"), (dict(block_k=48), "block_k"),
    (dict(block_n=8), "block_n"), (dict(block_n=96), "block_n"), (dict(shrink_warps=3), "shrink_warps"),
    (dict(expand_warps=0), "expand_warps"), (dict(split_k=0), ">= 1"), (dict(n_per_prog=0), ">= 1"),
    (dict(num_stages=0), ">= 1"), (dict(block_k=32.0), "block_k must be an int"),
    (dict(split_k=True), "split_k must be an int"), (dict(expand_rows=True), "n_per_prog == block_n"),
    (dict(expand_maxnreg=16), "expand_maxnreg"), (dict(expand_maxnreg=256), "expand_maxnreg"),
    (dict(expand_maxnreg=168.0), "expand_maxnreg"),
    (dict(expand_rows=True, n_per_prog=32, expand_ahead=True), "expand_ahead"),
])
def test_kernel_config_refuses_what_the_compiler_would(bad: dict, says: str) -> None:
    """A K tile below 16 runs under the interpreter but fails to compile for the GPU (`tl.dot`
    needs K >= 16; seen on the H200): the config says so itself, as for other impossible knobs."""
    fields = dict(split_k=2, block_k=32, block_n=32, n_per_prog=64)
    with pytest.raises(ValueError, match=says):
        LoraKernelConfig(**{**fields, **bad})
    LoraKernelConfig(**fields)  # the same without the bad knob is fine

def test_plan_refuses_a_launch_bound_below_the_chunks() -> None:
    """Chunks past the launch bound would be skipped (their tokens left without LoRA, or with an
    unwritten delta): the plan refuses such a meta on the host."""
    from lorafleet.kernels.lora.launch import plan_lora_triton

    g = torch.Generator().manual_seed(23)
    tokens, slots, d_in = 20, 4, 16
    lora_a, _ = make_weights(g, slots, 16, d_in, [16], [[16] * slots], torch.float32, DEVICE)
    meta = build_lora_meta(torch.arange(tokens, dtype=torch.int32).remainder(slots).unsqueeze(1),
                           torch.ones(tokens, 1), slots, DEVICE)
    assert meta.num_chunks == slots
    meta.launch_chunks = slots - 1
    with pytest.raises(ValueError, match="launches cover 3"):
        plan_lora_triton(torch.randn(tokens, d_in, device=DEVICE), lora_a, [torch.zeros(slots, 16, 16, device=DEVICE)],
                         torch.full((1, slots), 16, dtype=torch.int32, device=DEVICE), meta)

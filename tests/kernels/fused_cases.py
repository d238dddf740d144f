"""Shared cases of the fused row kernels' tests (`test_rms_norm.py`, `test_rope_kv.py`,
`test_silu_mul.py`, `test_fused_delta.py`, `test_fused_decoder.py`): devices, dtypes, tolerances and
the inputs each op is fed.

Tolerances: fp32 2e-6 relative (one rounding apart); fp16/bf16 one ulp of the dtype, as
torch.testing's defaults (rtol 1e-3 / 1.6e-2): the kernels round where the torch path rounds,
but sum the squares in another order and compute sigmoid and rsqrt their own way.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import ModelConfig
from lorafleet.worker.models.llama import Rotary

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=2e-6), torch.float16: {}, torch.bfloat16: {}}


def rotary(head_dim: int, max_positions: int, device: str = DEVICE) -> Rotary:
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=4 * head_dim,
                                        intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                                        head_dim=head_dim, rope_theta=500000.0))
    return Rotary(config, max_positions, torch.device(device))


def norm_case(seed: int, tokens: int, hidden: int, dtype: torch.dtype, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * 3.0
    residual = torch.randn(tokens, hidden, generator=g)
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return x.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


BLOCK_SIZE = 4
NUM_BLOCKS = 6  # + 1: the sink block past them, as `ModelRunner` allocates
SINK = NUM_BLOCKS * BLOCK_SIZE
# Positions from 0 to 100k; the last two rows are padding: position 0, the sink slot.
POSITIONS = [0, 1, 17, 2047, 4096, 65_535, 99_999, 0, 0]
SLOTS = [3, 0, 23, 5, 12, 9, 17, SINK, SINK]


def rope_case(seed: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = DEVICE,
              positions: list[int] = POSITIONS, slots: list[int] = SLOTS):
    """qkv, positions, slots and NaN-filled caches; the padding rows repeat one token, as in a graph bucket
    (same token at position 0), so what lands in the sink does not depend on which row writes last."""
    g = torch.Generator().manual_seed(seed)
    tokens = len(positions)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    pad = [i for i, s in enumerate(slots) if s == SINK]
    if pad:
        qkv[pad] = qkv[pad[0]].clone()
    k_cache = torch.full((NUM_BLOCKS + 1, BLOCK_SIZE, kv_heads, head_dim), float("nan"))
    return (qkv.to(device, dtype), torch.tensor(positions, device=device), k_cache.to(device, dtype),
            k_cache.clone().to(device, dtype), torch.tensor(slots, device=device))


# The seed model's shape, for the GPU cases (run on the H200).
SEED = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336)

"""bench/vllm_lora.py: vLLM's LoRA ops, loaded through the shim, compute what our reference does on
the benchmark's own inputs (small shapes, the interpreter), so the GPU run only has to time them.
Needs vLLM's ops unpacked by `python -m bench.vllm_lora --fetch` (a 340 MB download, not done in CI):
skipped without them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "bench" / ".vllm"

pytestmark = [
    pytest.mark.skipif(not (SRC / "vllm/lora/ops/triton_ops/lora_shrink_op.py").is_file(),
                       reason="vLLM's ops not fetched (python -m bench.vllm_lora --fetch)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter"),
]


@pytest.fixture
def vl(tmp_path, monkeypatch):
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the repo root itself would shadow the stdlib's operator
    monkeypatch.syspath_prepend(str(tmp_path))
    from bench import kernel_cases as kb
    from bench import vllm_lora

    monkeypatch.setattr(kb, "DEVICE", "cpu")
    monkeypatch.setattr(kb, "DTYPE", torch.float16)  # vLLM's ops take fp16/bf16; bf16 dot is wrong here
    monkeypatch.setattr(kb, "L2_FLUSH_BYTES", 0)  # two weight copies
    monkeypatch.setattr(kb, "MODULES", {"qkv": (64, [64, 16, 16]), "down": (96, [32])})
    return kb, vllm_lora


@pytest.mark.parametrize("module,tokens,adapters,rank,pool_rank", [
    ("qkv", 16, 8, 16, 16),  # three slices of different widths
    ("down", 16, 16, 8, 64),  # a token an adapter; vLLM pads rank 8 to the pool's 64
    ("qkv", 5, 1, 16, 16),  # one adapter for all
])
def test_vllm_ops_match_the_reference(vl, module, tokens, adapters, rank, pool_rank):
    kb, vllm_lora = vl
    ops = vllm_lora.VllmOps(SRC)
    case = kb.Case(module, tokens, adapters, rank, pool_rank)
    row = vllm_lora.run_case(ops, case, torch.Generator().manual_seed(tokens), device="cpu", timed=False)
    assert row["lora_err"] < 2e-3 and row["vllm_err"] < 2e-3, row


def test_each_case_starts_without_vllms_pointer_tables(vl):
    """vLLM caches its per-slice pointer, stride and size tables by the weights' data pointers, so a
    case whose weights landed where an earlier case's were would run with the earlier shapes: a
    case empties those caches first (whether memory is reused cannot be forced here; that the
    earlier entries are gone can be checked)."""
    kb, vllm_lora = vl
    ops = vllm_lora.VllmOps(SRC)
    ops.forget_weights()
    a_old = [torch.zeros(2, 16, 64, dtype=torch.float16) for _ in range(3)]
    b_old = [torch.zeros(2, n, 16, dtype=torch.float16) for n in (64, 16, 16)]
    ops.utils._get_lora_a_ptr(a_old, "cpu")
    ops.utils._get_lora_b_ptr(b_old, 0, "cpu")
    assert ops.utils._LORA_A_PTR_DICT and ops.utils._LORA_B_PTR_DICT
    row = vllm_lora.run_case(ops, kb.Case("qkv", 6, 2, 16, 16), torch.Generator().manual_seed(2), device="cpu",
                             timed=False)
    assert row["vllm_err"] < 2e-3, row
    assert all(a_old[0].data_ptr() not in key for key in ops.utils._LORA_A_PTR_DICT)


def test_a_wrong_scale_is_caught(vl, monkeypatch):
    """The check has teeth: vLLM's B without the adapters' scales folded in fails it."""
    kb, vllm_lora = vl
    ops = vllm_lora.VllmOps(SRC)
    real = vllm_lora.vllm_weights
    monkeypatch.setattr(vllm_lora, "vllm_weights", lambda inp, rank, scale: real(inp, rank, torch.ones_like(scale)))
    row = vllm_lora.run_case(ops, kb.Case("down", 8, 4, 16, 16), torch.Generator().manual_seed(1), device="cpu",
                             timed=False)
    assert row["vllm_err"] > 5e-2, row

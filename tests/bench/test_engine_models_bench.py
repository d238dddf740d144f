"""bench/engine_models.py end to end on CPU (`--tiny`): every family's engine is built under its own
checkpoint names, timed, and written as the rows issue 50 asks for (Llama's also with DoRA adapters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_engine_bench import run_bench


@pytest.mark.slow
def test_tiny_models_benchmark(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "engine_models", "--adapters", "0,2", "--batch", "4", "--prompt-len", "16",
                     "--new-tokens", "4")
    rows = data["rows"]
    assert {(r["arch"], r["adapters"]) for r in rows} == {(a, d) for a in ("llama", "qwen3", "gemma2") for d in (0, 2)}
    for r in rows:
        assert set(r) >= {"arch", "adapter_kind", "adapters", "batch", "rank", "tokens_per_s", "weight_bytes",
                          "kv_bytes", "step_bytes", "vs_llama_step_bytes"}
        assert r["tokens_per_s"] > 0 and r["weight_bytes"] > 0
    llama = next(r for r in rows if r["arch"] == "llama" and r["adapters"] == 0)
    assert llama["vs_llama"] == llama["vs_llama_step_bytes"] == 1.0
    # The K and V of 4 sequences at the mean context 16 + 4/2 over 2 layers, bf16: Gemma 2's tiny
    # shape has as many KV heads of the same size as Llama's, so the same bytes.
    gemma = next(r for r in rows if r["arch"] == "gemma2" and r["adapters"] == 0)
    assert llama["kv_bytes"] == gemma["kv_bytes"] == 4 * 18 * 2 * 2 * (2 * 16) * 2
    # Llama's untied table is read B rows at a time, not whole: the step reads less than its weights;
    # Gemma 2's table is its lm_head, read whole.
    assert llama["step_bytes"] < llama["weight_bytes"] + llama["kv_bytes"]
    assert gemma["step_bytes"] == gemma["weight_bytes"] + gemma["kv_bytes"]
    kinds = {(r["arch"], r["adapter_kind"]) for r in rows if r["adapters"] == 2}
    assert kinds == {("llama", "lora"), ("llama", "dora"), ("qwen3", "lora"), ("gemma2", "lora")}
    dora = next(r for r in rows if r["adapter_kind"] == "dora")
    assert dora["vs_llama"] == 1.0 and dora["vs_lora"] > 0

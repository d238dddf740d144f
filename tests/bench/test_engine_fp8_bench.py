"""bench/engine.py --weights (bench/engine_fp8.py) end to end on CPU (`--tiny`): both weights kinds
timed, every row's byte bound made of the bytes a step reads, the quality figures present."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_engine_bench import run_bench


@pytest.mark.slow
def test_tiny_fp8_engine_benchmark(tmp_path: Path, demo_model: Path) -> None:
    data = run_bench(tmp_path, "engine", "--weights", "bf16,fp8", "--adapters", "2", "--batch", "4",
                     "--prompt-lens", "16", "--new-tokens", "4", "--quality-model", str(demo_model),
                     "--quality-prompts", "3", "--quality-new-tokens", "3")
    rows = data["rows"]
    assert {(r["weights"], r["adapters"]) for r in rows} == {(w, d) for w in ("bf16", "fp8") for d in (0, 2)}
    assert all(r["tokens_per_s"] > 0 and r["byte_bound_tokens_per_s"] > 0 for r in rows)
    by = {(r["weights"], r["adapters"]): r for r in rows}
    # FP8 projections read one byte a weight: fewer bytes a step, a higher bound; adapters add bytes.
    assert by[("fp8", 0)]["step_bytes"] < by[("bf16", 0)]["step_bytes"] < by[("bf16", 2)]["step_bytes"]
    assert by[("fp8", 0)]["byte_bound_tokens_per_s"] > by[("bf16", 0)]["byte_bound_tokens_per_s"]
    q = data["quality"]
    assert "error" not in q and q["positions"] > 0 and 0 <= q["mean_kl"] <= q["max_kl"] and 0 <= q["greedy_agree"] <= 1
    assert set(q["layers"]) == {"qkv", "o", "gate_up", "down"} and all(0 < e < 0.05 for e in q["layers"].values())
    assert "fp8_vs_bf16_base_prompt_16" in data["summary"]

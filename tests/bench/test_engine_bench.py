"""bench/engine.py end to end on CPU (`--tiny`): the script runs, writes its JSON, and measures what
it says it measures (every prompt prefilled from scratch, no part lost to an error row).

The GPU numbers come from the same script (`bash bench/gpu_engine.sh`), so a broken or misleading
benchmark shows here first: a TTFT that re-sent one prompt once read a prefix-cache hit as a prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_engine_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    cmd = [sys.executable, "-m", "bench.engine", "--tiny", "--adapters", "1,2", "--prompt-lens", "16",
           "--new-tokens", "4", "--breakdown", "2", "--out", str(out)]
    # `bench` importable without the repo root on sys.path (its operator/ would shadow the stdlib's).
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "bench").symlink_to(ROOT / "bench")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "path"), "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["mode"], r["adapters"]) for r in rows} == {(m, d) for m in ("graphs", "async") for d in (0, 1, 2)}
    assert all(r["tokens_per_s"] > 0 and r["prefix_hit_tokens"] == 0 for r in rows)
    assert all(r["vs_base"] == 1.0 for r in rows if r["adapters"] == 0)
    assert len(data["ttft_ms_512_runs"]) == 5 and data["ttft_ms_512"] in data["ttft_ms_512_runs"]
    assert data["ttft_host"] and data["breakdown"] and "error" not in data["breakdown"][0]
    assert data["async_scheduling"]["overlapped"] > 0  # the async mode really pipelined steps


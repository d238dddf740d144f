"""bench/worker_stream.py end to end at a small size: the worker streams with its forward a fixed
wait, so the tokens a second can reach but never pass concurrency / step; rows carry the CPU figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_a_round_streams_below_the_steps_bound(bench_importable, tmp_path: Path) -> None:
    from bench import worker_stream

    out = tmp_path / "ws.json"
    assert worker_stream.main(["--step-ms", "20", "--concurrency", "8", "--new-tokens", "16", "--prompt", "16",
                               "--seconds", "3", "--rounds", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["errors"] == 0 and row["requests"] > 8
    assert row["ideal_tokens_per_s"] == 8 * 1000 / 20
    # Every step waits 20 ms: more than 400 tokens/s would mean the forward was not the wait.
    assert 0.2 < row["ratio"] <= 1.0
    assert row["http_us_per_token"] > 0 and row["process_us_per_token"] >= row["http_us_per_token"]

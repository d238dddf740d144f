"""`bench/sched_scale.py` on a small fleet: it runs, decides through every path, and writes its rows."""

from __future__ import annotations

import json


def test_small_run_writes_rows_with_every_path(bench_importable, tmp_path):
    from bench.sched_scale import main

    out = tmp_path / "sched.json"
    args = ["--sizes", "24x3000", "--decisions", "1500", "--warmup", "100", "--plain-decisions", "20",
            "--repeats", "2", "--out", str(out), "--plot", ""]
    assert main(args) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["replicas"], row["adapters"]) == (24, 3000)
    assert len(row["repeats"]) == 2
    assert 0 < row["decision_p50_us"] <= row["decision_p99_us"]
    assert row["best_repeat_decision_plus_update_p99_us"] <= row["decision_plus_update_p99_us"] + 1e-9
    paths = row["repeats"][0]["decision_plus_update_by_path"]
    assert set(paths) == {"cold", "drawn", "holders"}  # more than 8 holders of the top adapters at 24
    assert abs(sum(p["share"] for p in paths.values()) - 1.0) < 1e-9

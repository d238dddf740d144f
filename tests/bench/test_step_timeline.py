"""bench/step_timeline.py's analysis on a hand-made kernel timeline (the GPU run feeds it CUPTI's)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def timeline(tmp_path, monkeypatch):
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the repo root itself would shadow the stdlib's operator
    monkeypatch.syspath_prepend(str(tmp_path))
    from bench import step_timeline

    return step_timeline


def ev(name, stream, start, end):
    return {"name": name, "stream": stream, "start": start, "end": end}


def test_gaps_waiting_for_the_side_stream_are_told_apart(timeline) -> None:
    # One step. Main stream 7: gemm 0-10, rope 15-17 (gap 5: the LoRA on stream 9 ended at 14),
    # gemm 20-30 (gap 3: nothing on the side ended in it), norm 30-31 (no gap).
    events = [ev("gemm_a", 7, 0, 10), ev("shrink", 9, 2, 8), ev("expand", 9, 9, 14), ev("rope", 7, 15, 17),
              ev("gemm_b", 7, 20, 30), ev("norm", 7, 30, 31)]
    r = timeline.analyse(sorted(events, key=lambda e: e["start"]), steps=1)
    assert r["span_ms"] == pytest.approx(0.031)
    assert r["main_busy_ms"] == pytest.approx(0.023)
    assert r["gaps_ms"] == pytest.approx(0.008)
    assert r["side_wait_ms"] == pytest.approx(0.004)  # rope waited from 10 to 14 for the expand
    assert r["side_busy_ms"] == pytest.approx(0.011)
    assert r["side_hidden_ms"] == pytest.approx(0.007)  # shrink 2-8 and expand 9-10 under gemm_a
    assert r["main_kernels_per_step"] == 4 and r["side_kernels_per_step"] == 2
    assert r["largest_gaps"][0] == {"us": 5, "waited_for_side_us": 4, "after": "gemm_a", "before": "rope"}
    assert r["main_kernels_us"] == {"gemm_a": 10, "gemm_b": 10, "rope": 2, "norm": 1}
    assert r["side_kernels_us"] == {"shrink": 6, "expand": 5}


def test_union_of_intervals(timeline) -> None:
    assert timeline.busy([(0, 2), (1, 3), (5, 6)]) == 4
    assert timeline.busy([]) == 0
    assert timeline.analyse([], steps=3) == {"note": "no device kernels recorded (CPU run)"}

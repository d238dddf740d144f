"""bench/step_timeline.py's analysis on a hand-made kernel timeline (the GPU run feeds it CUPTI's)."""

from __future__ import annotations

import pytest


@pytest.fixture
def timeline(bench_importable):
    from bench import step_timeline

    return step_timeline


def ev(name, stream, start, end):
    return {"name": name, "stream": stream, "start": start, "end": end}


def test_gaps_waiting_for_the_side_path_are_told_apart(timeline) -> None:
    # Two steps, each bracketed by host-device copies (times in µs). Step one: gemm 0-100 (stream 7),
    # the LoRA on streams 9 and 12 (a replayed graph reports branches as streams of their own), rope
    # 150-170 (gap 50: the expand ended at 140), gemm 200-300 on stream 11 (gap 30: nothing of the
    # LoRA ended in it), norm 300-310 (no gap). Step two, after a long host pause: one gemm; the
    # pause is no gap.
    events = [ev("Memcpy HtoD", 7, -50, -10), ev("gemm_a", 7, 0, 100), ev("_lora_shrink_kernel", 9, 20, 80),
              ev("_lora_expand_kernel", 12, 90, 140), ev("rope", 7, 150, 170), ev("gemm_b", 11, 200, 300),
              ev("norm", 7, 300, 310), ev("Memcpy DtoH", 7, 320, 330), ev("Memcpy HtoD", 7, 5000, 5010),
              ev("gemm_a", 7, 5100, 5200), ev("Memcpy DtoH", 7, 5210, 5220)]
    r = timeline.analyse(sorted(events, key=lambda e: e["start"]), steps=2)
    assert r["span_ms"] == pytest.approx(0.205)  # (310 + 100) / 2 µs
    assert r["main_busy_ms"] == pytest.approx(0.165)
    assert r["gaps_ms"] == pytest.approx(0.04)
    assert r["side_wait_ms"] == pytest.approx(0.02)  # rope waited from 100 to 140 for the expand
    assert r["side_busy_ms"] == pytest.approx(0.055)
    assert r["side_hidden_ms"] == pytest.approx(0.035)  # shrink 20-80 and expand 90-100 under gemm_a
    assert r["main_kernels_per_step"] == 2 and r["side_kernels_per_step"] == 1  # 5 and 2 kernels over 2 steps
    assert r["largest_gaps"][0] == {"us": 50, "waited_for_side_us": 40, "after": "gemm_a", "before": "rope"}
    assert r["main_kernels_us"] == {"gemm_a": 100, "gemm_b": 50, "rope": 10, "norm": 5}
    assert r["side_kernels_us"] == {"_lora_shrink_kernel": 30, "_lora_expand_kernel": 25}


def test_a_fill_inside_a_gemm_is_side_path_and_makes_no_gap(timeline) -> None:
    """The delta's memset runs beside the GEMM; a main-path kernel nested in another one's span
    does not open a gap either: idle time counts from the latest end so far."""
    fill = "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, x>"
    events = [ev("gemm", 7, 0, 100), ev(fill, 7, 2, 4), ev("_lora_shrink_kernel", 9, 5, 60),
              ev("small", 11, 10, 20), ev("rope", 7, 101, 110)]
    r = timeline.analyse(events, steps=1)
    assert r["gaps_ms"] == pytest.approx(0.001) and r["side_wait_ms"] == 0  # 100 -> 101 only
    assert r["largest_gaps"][0] == {"us": 1, "waited_for_side_us": 0, "after": "gemm", "before": "rope"}
    assert r["side_kernels_per_step"] == 2 and r["main_kernels_per_step"] == 3


def test_union_of_intervals(timeline) -> None:
    assert timeline.busy([(0, 2), (1, 3), (5, 6)]) == 4
    assert timeline.busy([]) == 0
    assert timeline.analyse([], steps=3) == {"note": "no device kernels recorded (CPU run)"}

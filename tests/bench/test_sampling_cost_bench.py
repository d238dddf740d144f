"""bench/sampling_cost.py runs end to end on the CPU (small batch and vocabulary) and writes a row
per sampling mode and draw, and per piece."""

from __future__ import annotations

import json
import sys


def test_writes_a_row_per_mode_and_piece(bench_importable, tmp_path, monkeypatch) -> None:
    from bench import sampling_cost

    out = tmp_path / "cost.json"
    monkeypatch.setattr(sys, "argv", ["sampling_cost", "--batch", "4", "--vocab", "3000", "--repeats", "2",
                                      "--device", "cpu", "--out", str(out)])
    sampling_cost.main()
    rows = json.loads(out.read_text())["rows"]
    modes = [(r["name"], r["draw"]) for r in rows if r["kind"] == "mode"]
    assert modes == [(m, d) for m in sampling_cost.MODES for d in ("torch", "triton")]
    assert len([r for r in rows if r["kind"] == "piece"]) == 5 and all(r["us"] > 0 for r in rows)

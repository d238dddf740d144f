"""bench/logit_edits.py runs end to end on the CPU (torch backend, a small vocabulary) and writes a
row per case, each timed against the same sampling without edits."""

from __future__ import annotations

import json
import sys


def test_writes_a_row_per_case(bench_importable, tmp_path, monkeypatch) -> None:
    from bench import logit_edits

    out = tmp_path / "edits.json"
    monkeypatch.setattr(sys, "argv", ["logit_edits", "--vocab", "500", "--batch", "8", "--steps", "4",
                                      "--device", "cpu", "--backends", "torch", "--out", str(out)])
    logit_edits.main()
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["sampling"], r["edits"], r["edited_rows"]) for r in rows}
    assert len(rows) == len(cases) == 2 * (1 + 2 * (len(logit_edits.EDITS) - 1))
    assert all(r["vs_none"] == 1.0 for r in rows if r["edits"] == "none")
    assert all(r["step_us"] > 0 and r["backend"] == "torch" for r in rows)

"""worker/demo_assets.py: the first `lorafleet up` shows its own progress only (the libraries'
progress bars and deprecation notices stay out of it), and leaves transformers as it found it."""

from __future__ import annotations

import warnings

from transformers.utils import logging as hf_logging

from lorafleet.worker.demo_assets import DEMO_ADAPTERS, make_demo_assets


def test_making_the_assets_prints_no_library_noise(tmp_path, capfd) -> None:
    steps: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_demo_assets(tmp_path / "assets", steps.append)
    noisy = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
             and any(lib in w.filename for lib in ("transformers", "peft"))]
    assert noisy == [], [str(w.message) for w in noisy]
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err
    assert steps == ["tokenizer", "model", *(f"adapter {a.name}" for a in DEMO_ADAPTERS)]
    assert hf_logging.is_progress_bar_enabled()  # given back as it was
    assert (tmp_path / "assets" / ".complete").exists()

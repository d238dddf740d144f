"""bench/overlap_sweep.py's knob lookup: every knob a variant sets resolves to an attribute that exists
(a knob renamed or moved in the kernels would otherwise fail only on the GPU, after the model is built)."""

from __future__ import annotations

import pytest


@pytest.fixture
def sweep(bench_importable):
    from bench import overlap_sweep

    return overlap_sweep


def test_every_variants_knobs_have_a_home(sweep) -> None:
    knobs = set(sweep.KERNEL_KNOBS)
    for settings in sweep.VARIANTS.values():
        if len(settings) > 6:
            knobs |= set(settings[6])
    assert {"CHUNK_META_ROUND", "linear_deferred", "ONE_LAUNCH", "launch_shrink"} <= knobs
    for knob in knobs:
        home, attr = sweep.knob_home(knob)
        assert hasattr(home, attr), knob


def test_a_knob_nowhere_is_named(sweep) -> None:
    with pytest.raises(KeyError, match="NO_SUCH_KNOB"):
        sweep.knob_home("NO_SUCH_KNOB")

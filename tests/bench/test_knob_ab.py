"""bench/knob_ab.py's command line: settings split on top-level commas and read as Python literals,
each a LoRA tuning field's value, checked before anything runs."""

from __future__ import annotations

import pytest


@pytest.fixture
def knob_ab(bench_importable):
    from bench import knob_ab

    return knob_ab


def test_settings_keep_tuples_and_read_literals(knob_ab) -> None:
    parts = knob_ab.split_settings("(True, False),(False, False), tile ,32,[1, 2]")
    assert parts == ["(True, False)", "(False, False)", "tile", "32", "[1, 2]"]
    assert [knob_ab.parse_setting(p) for p in parts] == [(True, False), (False, False), "tile", 32, [1, 2]]


def test_unknown_knob_is_a_usage_error(knob_ab, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        knob_ab.main(["--knob", "NO_SUCH_KNOB", "--settings", "1,2"])
    assert exc.value.code == 2 and "LoraTuning has no field NO_SUCH_KNOB" in capsys.readouterr().err


def test_a_bad_setting_is_a_usage_error(knob_ab, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        knob_ab.main(["--knob", "split_sum", "--settings", "loop,twice"])
    assert exc.value.code == 2 and "--settings twice" in capsys.readouterr().err


def test_a_setting_is_a_tuning_passed_in_not_a_module_patched(knob_ab) -> None:
    from lorafleet.kernels.lora.tuning import active_tuning

    before = active_tuning()
    t = knob_ab.tuning_for("shrink_rows", [])
    assert t.shrink_rows == () and t.expand_rows == before.expand_rows
    assert active_tuning() is before and before.shrink_rows == (256, 4)


@pytest.mark.parametrize("settings", ["loop,loop", "loop,", "loop,,unroll"])
def test_repeated_or_empty_settings_are_a_usage_error(knob_ab, capsys, settings) -> None:
    with pytest.raises(SystemExit) as exc:
        knob_ab.main(["--knob", "split_sum", "--settings", settings])
    assert exc.value.code == 2 and "distinct, non-empty" in capsys.readouterr().err


def test_a_field_the_launch_reads_itself_is_a_usage_error(knob_ab, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        knob_ab.main(["--knob", "max_unrolled_splits", "--settings", "16,32"])
    assert exc.value.code == 2 and "LORAFLEET_LORA_TUNING" in capsys.readouterr().err

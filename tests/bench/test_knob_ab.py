"""bench/knob_ab.py's command line: settings split on top-level commas and read as Python literals."""

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
    assert exc.value.code == 2 and "lora_config has no NO_SUCH_KNOB" in capsys.readouterr().err


@pytest.mark.parametrize("settings", ["loop,loop", "loop,", "loop,,unroll"])
def test_repeated_or_empty_settings_are_a_usage_error(knob_ab, capsys, settings) -> None:
    with pytest.raises(SystemExit) as exc:
        knob_ab.main(["--knob", "EXPAND_SPLIT_SUM", "--settings", settings])
    assert exc.value.code == 2 and "distinct, non-empty" in capsys.readouterr().err

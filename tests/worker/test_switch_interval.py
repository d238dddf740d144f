"""LORAFLEET_SWITCH_INTERVAL_US (worker/envs.py): the GIL switch interval the engine thread runs under."""

import sys

import pytest

from lorafleet.worker.engine.async_engine import set_switch_interval


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unset_leaves_the_interpreter_alone(restore_interval):
    sys.setswitchinterval(0.004)
    set_switch_interval(None)
    assert sys.getswitchinterval() == pytest.approx(0.004)


def test_microseconds_set_the_interval(restore_interval):
    set_switch_interval(200)
    assert sys.getswitchinterval() == pytest.approx(200e-6)


@pytest.mark.parametrize("bad", [0, -5])
def test_a_non_positive_interval_is_refused(restore_interval, bad):
    with pytest.raises(ValueError, match="LORAFLEET_SWITCH_INTERVAL_US"):
        set_switch_interval(bad)

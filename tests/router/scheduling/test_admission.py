"""Frequency-aware cache admission, table-driven."""

from __future__ import annotations

import pytest

from lorafleet.router.scheduling.admission import FrequencyAdmission
from lorafleet.router.scheduling.types import AdmissionPlan, EndpointView

FREQ = {"hot": 50.0, "warm": 10.0, "cool": 3.0, "rare": 1.0, "new": 5.0, "p": 2.0}


def endpoint(resident: set[str], cap: int, active: set[str] = frozenset(), pinned: set[str] = frozenset()):
    return EndpointView(
        "e", cpu=frozenset(resident), max_cpu_loras=cap, active=frozenset(active), pinned=frozenset(pinned)
    )


@pytest.mark.parametrize(
    ("adapters", "resident", "cap", "active", "pinned", "expected"),
    [
        # Already resident: nothing to do.
        (("hot",), {"hot"}, 4, set(), set(), AdmissionPlan()),
        # Room beyond the scratch slot: admit without evicting.
        (("new",), {"hot"}, 4, set(), set(), AdmissionPlan(admit=True)),
        # Full up to the scratch slot: the newcomer beats the least popular idle resident.
        (
            ("new",),
            {"hot", "warm", "rare"},
            4,
            set(),
            set(),
            AdmissionPlan(unload_before=("rare",), admit=True),
        ),
        # ... but not one that is busy or pinned: the next least popular goes.
        (
            ("new",),
            {"hot", "cool", "rare"},
            4,
            {"rare"},
            set(),
            AdmissionPlan(unload_before=("cool",), admit=True),
        ),
        (
            ("new",),
            {"hot", "cool", "rare"},
            4,
            set(),
            {"rare"},
            AdmissionPlan(unload_before=("cool",), admit=True),
        ),
        # Less popular than every resident: borrow the scratch slot, unload after.
        (("rare",), {"hot", "warm", "cool"}, 4, set(), set(), AdmissionPlan(admit=False)),
        # Cache completely full and not worth a slot: free the least popular idle resident anyway.
        (
            ("rare",),
            {"hot", "warm", "cool", "p"},
            4,
            set(),
            set(),
            AdmissionPlan(unload_before=("p",), admit=False),
        ),
        # Composed request: both missing, two victims needed.
        (
            ("new", "warm"),
            {"hot", "cool", "rare", "p"},
            5,
            set(),
            set(),
            AdmissionPlan(unload_before=("rare", "p"), admit=True),
        ),
    ],
)
def test_plan(adapters, resident, cap, active, pinned, expected):
    plan = FrequencyAdmission(scratch_slots=1).plan(
        adapters, endpoint(resident, cap, active, pinned), FREQ.__getitem__
    )
    assert plan == expected


@pytest.mark.parametrize(
    ("resident", "cap", "expected"),
    [
        # A spill copy never takes a slot, even with room to spare or a popular newcomer ...
        ({"hot"}, 4, AdmissionPlan(admit=False)),
        ({"warm", "cool"}, 4, AdmissionPlan(admit=False)),
        # ... and frees only what it needs to fit, least popular first.
        ({"hot", "warm", "cool", "p"}, 4, AdmissionPlan(unload_before=("p",), admit=False)),
    ],
)
def test_transient_plan(resident, cap, expected):
    plan = FrequencyAdmission(scratch_slots=1).plan(
        ("new",), endpoint(resident, cap), FREQ.__getitem__, transient=True
    )
    assert plan == expected

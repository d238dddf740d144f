"""Status phase machine (pure)."""

from __future__ import annotations

import pytest

from lorafleet.operator.status import AdapterObservation, adapter_phase, adapter_status, status_changed


@pytest.mark.parametrize(
    ("obs", "phase"),
    [
        (AdapterObservation(1, desired=2, placed=2, ready=2, loading=False), "Ready"),
        (AdapterObservation(1, desired=2, placed=2, ready=0, loading=True), "Loading"),
        (AdapterObservation(1, desired=2, placed=1, ready=1, loading=False), "Degraded"),
        (AdapterObservation(1, desired=1, placed=0, ready=0, loading=False), "Pending"),
        (AdapterObservation(1, desired=0, placed=0, ready=0, loading=False), "Ready"),
        (AdapterObservation(1, 1, 1, 1, False, failure=("DigestMismatch", "x")), "Failed"),
    ],
)
def test_phase(obs: AdapterObservation, phase: str) -> None:
    assert adapter_phase(obs) == phase


def test_unchanged_status_needs_no_write_and_keeps_transition_time() -> None:
    obs = AdapterObservation(3, desired=1, placed=1, ready=1, loading=False, digest="sha256:ab")
    first = adapter_status(obs, None)
    second = adapter_status(obs, first)
    assert not status_changed(first, second)
    assert second["conditions"] == first["conditions"]
    degraded = adapter_status(AdapterObservation(3, 1, 1, 0, False), first)
    assert status_changed(first, degraded)
    assert degraded["phase"] == "Pending"
    assert set(degraded) == {"phase", "readyReplicas", "desiredReplicas", "conditions", "observedGeneration"}

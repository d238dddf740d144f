"""The simulator's incremental FleetIndex shows what the replicas' views show at every decision,
and the indexed policy decides as `Policy.schedule` on those views, past the size where the
rendezvous candidates narrow the choice (24 replicas > 8 candidates) and at both loads."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("load", [0.7, 0.95])
def test_index_tracks_the_replicas_and_decides_as_the_reference(bench_importable, load):
    from bench.fleet_sim_model import SimConfig, Simulation
    from bench.fleet_sim_workload import make_trace
    from lorafleet.router.scheduling.policies import lorafleet_policy

    cfg = SimConfig(replicas=24, adapters=3000, requests=1500)
    sim = Simulation(cfg, lorafleet_policy(), load, check_index=True)  # asserts at every decision
    metrics = sim.run(make_trace(cfg, load * cfg.capacity_rps()))
    assert sim.index is not None and metrics["served_total"] == 1500

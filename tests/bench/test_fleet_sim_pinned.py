"""The fleet simulator's figures on a small fleet, pinned: a faster simulator or a policy index must
reproduce them exactly (the simulation is deterministic), so any change of results is deliberate.

Figures recorded from the simulator and policies as they stood before the decision index
(8 replicas × 1,000 adapters, 3,000 requests, seed 1). At 8 replicas every replica is one of the
policy's rendezvous candidates, so the indexed policy must decide exactly as the plain one did.
The `lorafleet` rows changed once since, deliberately: no spill copies while half the replicas have
every GPU slot taken (`SlotQueue.full_share`); before it they read 70%: (142.666667, 41.463061,
416.21083, 382.666667, 1.077333), 90%: (160.0, 53.059651, 3377.730039, 14275.0, 1.059556).
"""

from __future__ import annotations

import pytest

# (cold loads / 1k, TTFT p50 ms, TTFT p99 ms, deferrals / 1k, imbalance max/mean)
PINNED = {
    ("lorafleet", 0.7): (140.444444, 41.231589, 532.562116, 438.666667, 1.077333),
    ("round-robin", 0.7): (393.333333, 1698.216539, 4837.100327, 71331.666667, 1.002667),
    ("least-request", 0.7): (380.0, 1677.213312, 3794.63144, 64046.666667, 1.041778),
    ("gie-lora-affinity", 0.7): (294.666667, 44.291536, 630.483364, 1114.666667, 1.127111),
    ("chwbl", 0.7): (187.111111, 44.879907, 1953.278024, 6473.333333, 1.152),
    ("lorafleet", 0.9): (136.888889, 53.527028, 3601.265238, 14436.0, 1.048889),
    ("round-robin", 0.9): (400.0, 3858.90676, 9844.000269, 158316.333333, 1.002667),
    ("least-request", 0.9): (399.555556, 3904.63295, 9927.718957, 159047.666667, 1.016889),
    ("gie-lora-affinity", 0.9): (249.777778, 90.982812, 3806.055561, 12382.666667, 1.152),
    ("chwbl", 0.9): (181.333333, 90.291022, 6797.798081, 32037.0, 1.184),
}
KEYS = ("cold_loads_per_1k", "ttft_p50_ms", "ttft_p99_ms", "deferrals_per_1k", "load_imbalance_max_over_mean")


@pytest.mark.parametrize(("policy", "load"), sorted(PINNED))
def test_small_run_reproduces_pinned_figures(bench_importable, policy, load):
    from bench.fleet_sim import run_one
    from bench.fleet_sim_model import SimConfig

    m = run_one(SimConfig(requests=3000), load, policy)
    got = tuple(round(m[k], 6) for k in KEYS)
    assert got == pytest.approx(PINNED[(policy, load)], rel=1e-6, abs=1e-6)

"""`fleet_sim --fleet`: runs made in separate processes land in one fleet entry of the results file."""

from __future__ import annotations

import pytest


def result(cfg, runs):
    from dataclasses import asdict

    return {"config": asdict(cfg), "capacity_rps": cfg.capacity_rps(), "runs": runs}


def run(policy, load, cold):
    return {"policy": policy, "load": load, "cold_loads_per_1k": cold, "floor_per_1k": 10.0, "ttft_p99_ms": 100.0}


def test_merge_replaces_same_policy_and_load_and_keeps_the_rest(bench_importable):
    from bench.fleet_sim import merge_fleet
    from bench.fleet_sim_model import SimConfig

    cfg = SimConfig(replicas=64, adapters=8000, requests=100)
    stored = merge_fleet({"runs": ["default run"]}, result(cfg, [run("lorafleet", 0.7, 20.0), run("chwbl", 0.7, 50.0)]), cfg)
    stored = merge_fleet(stored, result(cfg, [run("lorafleet", 0.7, 15.0), run("dynamo-lora-hrw", 0.7, 40.0)]), cfg)
    entry = stored["fleets"]["64x8000x100"]
    assert [(r["policy"], r["cold_loads_per_1k"]) for r in entry["runs"]] == [
        ("lorafleet", 15.0), ("chwbl", 50.0), ("dynamo-lora-hrw", 40.0)
    ]
    assert entry["verdicts"][0]["cold_over_best_other"] == pytest.approx(15.0 / 40.0)
    assert stored["runs"] == ["default run"]
    other = SimConfig(replicas=64, adapters=8000, requests=100, seed=2)
    with pytest.raises(SystemExit, match="another configuration"):
        merge_fleet(stored, result(other, [run("lorafleet", 0.7, 1.0)]), other)

"""Fleet simulator, the workload: a seeded Zipf/Poisson request trace and its offline floor."""

from __future__ import annotations

from collections import Counter

import numpy as np

from bench.fleet_sim_model import Req, SimConfig


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def make_trace(cfg: SimConfig, rate_rps: float) -> list[Req]:
    rng = np.random.default_rng(cfg.seed)
    probs = zipf_probabilities(cfg.adapters, cfg.zipf)
    # Popularity rank is shuffled onto names so hashing cannot get lucky on name order.
    names = [f"adapter-{i:04d}" for i in rng.permutation(cfg.adapters)]
    ranks = rng.choice(cfg.adapters, size=cfg.requests, p=probs)
    gaps = rng.exponential(1.0 / rate_rps, size=cfg.requests)
    outs = rng.integers(cfg.mean_output_tokens // 4, cfg.mean_output_tokens * 7 // 4 + 1, size=cfg.requests)
    times = np.cumsum(gaps)
    return [Req(i, float(times[i]), names[ranks[i]], int(outs[i])) for i in range(cfg.requests)]


def offline_floor_per_1k(cfg: SimConfig, trace: list[Req]) -> tuple[float, float]:
    """Requests for adapters beyond the fleet's combined CPU capacity (top ones held once each).

    Returns (analytic from the Zipf law, empirical over the measured part of the trace).
    """
    capacity = cfg.replicas * cfg.cpu_slots
    probs = zipf_probabilities(cfg.adapters, cfg.zipf)
    analytic = 1000 * float(probs[capacity:].sum())
    measured = trace[int(len(trace) * cfg.warmup_fraction) :]
    top = {name for name, _ in Counter(r.adapter for r in trace).most_common(capacity)}
    empirical = 1000 * sum(r.adapter not in top for r in measured) / len(measured)
    return analytic, empirical

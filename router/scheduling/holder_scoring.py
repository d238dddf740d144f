"""The lorafleet scorers over one adapter's holders at once (array operations, same arithmetic).

A popular adapter has copies on many replicas; scoring each in Python costs microseconds per copy.
Here each scorer is one array expression over all of them, evaluated with the same floating-point
operations in the same order as `Policy._score` (`w * clamp(score)` summed left to right), so the
totals are bit-identical. The clamps are left out where a score is already in [0, 1].
"""

from __future__ import annotations

import numpy as np

from lorafleet.router.scheduling.fleet_index import BUSY, CAPACITY, LOAD, MAX_LORAS, N_ACTIVE, FleetIndex
from lorafleet.router.scheduling.hashing import weight
from lorafleet.router.scheduling.scorers import (
    CacheVictim,
    HashAffinity,
    Load,
    Residency,
    SlotFree,
    SlotHeadroom,
)
from lorafleet.router.scheduling.types import Scorer

_U64 = float(2**64)


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def score_holders(
    scorers: tuple[tuple[float, Scorer], ...],
    key: str,
    index: FleetIndex,
    ids: np.ndarray,
    rows: np.ndarray,
    gpu: np.ndarray,
    active: np.ndarray,
    extra: np.ndarray,
) -> list[tuple[int, float]]:
    """(replica id, total score) for the holders that can be the best.

    `rows` are the holders' rows of `ReplicaArrays.table`; `gpu`/`active` say whether the adapter
    is in a GPU slot / running there; `extra` whether it would take a new GPU slot there. If the
    rendezvous term comes last it only breaks near-ties: it is computed for the holders within its
    weight of the best, the others are left out (they cannot win or tie).
    """
    n = len(ids)
    total = np.zeros(n)
    hash_last = isinstance(scorers[-1][1], HashAffinity)
    for w, scorer in scorers[:-1] if hash_last else scorers:
        if isinstance(scorer, Residency):
            s = np.where(gpu, _clamp(scorer.gpu), _clamp(scorer.cpu))
        elif isinstance(scorer, SlotFree):
            s = (rows[:, N_ACTIVE] + ~active <= rows[:, MAX_LORAS]).astype(np.float64)
        elif isinstance(scorer, CacheVictim):
            s = np.ones(n)  # resident: a load here evicts nothing
        elif isinstance(scorer, SlotHeadroom):
            maxl = rows[:, MAX_LORAS]
            s = np.where(active, 1.0, np.maximum(0.0, (maxl - (rows[:, BUSY] + extra)) / np.maximum(1, maxl)))
        elif isinstance(scorer, Load):
            s = np.maximum(0.0, 1.0 - rows[:, LOAD] / np.maximum(1, rows[:, CAPACITY]))
        elif isinstance(scorer, HashAffinity):
            s = np.array([weight(key, index.replicas[i].name) / _U64 for i in ids.tolist()])
        else:
            raise TypeError(f"no array form for scorer {scorer!r}")
        total = total + w * s
    if not hash_last:
        return list(zip(ids.tolist(), total.tolist(), strict=True))
    w_hash = scorers[-1][0]
    near = np.nonzero(total >= total.max() - w_hash - 1e-6)[0]
    reps = index.replicas
    return [
        (i, t + w_hash * _clamp(weight(key, reps[i].name) / _U64))
        for i, t in zip(ids[near].tolist(), total[near].tolist(), strict=True)
    ]

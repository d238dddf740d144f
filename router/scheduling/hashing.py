"""Rendezvous (highest-random-weight) hashing: a stable preference order of replicas per key.

A replica leaving moves only the keys it was first for; a replica joining takes ~1/n of keys.
blake2b, not `hash()`: the order must agree across processes and router replicas.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(key: str, node: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, nodes: Iterable[str]) -> list[str]:
    """Nodes from most to least preferred for `key`."""
    return sorted(nodes, key=lambda node: weight(key, node), reverse=True)


def bounded_load_limit(total_load: int, n: int, factor: float) -> float:
    """CHWBL's per-replica ceiling: `factor` × the mean load counting the request being placed."""
    if n <= 0:
        return 0.0
    return factor * (total_load + 1) / n

"""Two-level (skeleton) rendezvous order: a key's first k replicas without ranking every replica.

Plain rendezvous hashing ranks all n replicas per key. Here replicas fall into `GROUPS` fixed groups
(by a hash of their name); a key ranks the groups by weighted rendezvous (weight = the group's size,
so each replica is any key's first choice with probability 1/n), then the members of a group by
plain rendezvous. The order is: the best group's members best first, then the next group's, and so
on. Finding the first k costs one ranking of ≤ `GROUPS` groups plus one of a group's members
(~n / `GROUPS`), and churn moves few keys: a replica joining or leaving changes its own group's
weight and members only.

`skeleton_order` is the plain O(n) definition (the reference); `SkeletonRing` keeps the groups as
replicas come and go and walks a key's order lazily. Both use the same 64-bit hash (blake2b of the
key and of the name, combined by the splitmix64 finaliser), so every router process agrees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

GROUPS = 32
_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GROUP_SALT = 0x5EED5EED5EED5EED


def seed64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def mix64(x: int) -> int:
    z = (x + _GOLDEN) & _M
    z = ((z ^ (z >> 30)) * _C1) & _M
    z = ((z ^ (z >> 27)) * _C2) & _M
    return z ^ (z >> 31)


_LN_2_53 = 53 * float(np.log(2.0))
_U_GOLDEN, _U_C1, _U_C2 = np.uint64(_GOLDEN), np.uint64(_C1), np.uint64(_C2)
_U11, _U27, _U29, _U30, _U31 = (np.uint64(b) for b in (11, 27, 29, 30, 31))


def _mix64_np(x: np.ndarray) -> np.ndarray:
    z = x + _U_GOLDEN
    z = (z ^ (z >> _U30)) * _U_C1
    z = (z ^ (z >> _U27)) * _U_C2
    return z ^ (z >> _U31)


def member_weight(key_mix: int, node_mix: int) -> int:
    """Rendezvous weight of a node within its group: both sides already mixed, so one multiply and
    one shift spread their combination (the vectorised form is `_member_weights`)."""
    z = ((key_mix ^ node_mix) * _C2) & _M
    return z ^ (z >> 29)


def _member_weights(key_mix: np.ndarray, node_mixes: np.ndarray) -> np.ndarray:
    z = (node_mixes ^ key_mix) * _U_C2
    return z ^ (z >> _U29)


def group_of(name: str, groups: int = GROUPS) -> int:
    return seed64(name) % groups


def _salts(groups: int) -> np.ndarray:
    return np.array([mix64(mix64(_GROUP_SALT + g)) for g in range(groups)], dtype=np.uint64)


def group_weights(key_seed: int, salts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Weighted rendezvous over all groups at once, as ln(u) / size (larger is better; the same order
    as size / -ln(u)), u uniform in (0, 1) per (key, group); -inf for an empty group.

    Always over the full fixed-length arrays, so the reference and the ring compute the same floats.
    """
    z = _member_weights(np.uint64(mix64(key_seed)), salts) >> _U11  # type: ignore[arg-type]
    with np.errstate(divide="ignore", invalid="ignore"):
        w = (np.log(z.astype(np.float64) + 0.5) - _LN_2_53) / sizes
    return np.where(sizes > 0, w, -np.inf)


def skeleton_order(key: str, names: Iterable[str], groups: int = GROUPS) -> list[str]:
    """`names` from most to least preferred for `key` (O(n log n): the definition, for tests)."""
    names = list(names)
    k = seed64(key)
    km = mix64(k)
    sizes: np.ndarray = np.zeros(groups, dtype=np.float64)
    for n in names:
        sizes[group_of(n, groups)] += 1
    gw = group_weights(k, _salts(groups), sizes).tolist()
    return sorted(
        names,
        key=lambda n: (gw[group_of(n, groups)], group_of(n, groups), member_weight(km, mix64(seed64(n))), n),
        reverse=True,
    )


@dataclass(slots=True)
class _Group:
    members: list[str] = field(default_factory=list)  # sorted by name
    ids: list[int] = field(default_factory=list)  # caller's replica ids, aligned with members
    seeds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # mix64(seed64(name))


@dataclass(slots=True)
class SkeletonRing:
    """The groups, kept as replicas are added and removed; `walk(key)` yields ids in `skeleton_order`."""

    groups: int = GROUPS
    _groups: dict[int, _Group] = field(default_factory=dict)
    _group_of: dict[str, int] = field(default_factory=dict)
    _salt_arr: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    _sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    # key -> groups in order; valid while the group sizes are unchanged (cleared on churn)
    _order_cache: dict[str, tuple[int, ...]] = field(default_factory=dict)
    max_cached_keys: int = 200_000

    def __post_init__(self) -> None:
        self._salt_arr = _salts(self.groups)
        self._sizes = np.zeros(self.groups, dtype=np.float64)

    def __len__(self) -> int:
        return len(self._group_of)

    def add(self, name: str, ident: int) -> None:
        if name in self._group_of:
            return
        g = group_of(name, self.groups)
        self._group_of[name] = g
        grp = self._groups.setdefault(g, _Group())
        pairs = sorted([*zip(grp.members, grp.ids, strict=True), (name, ident)])
        grp.members = [p[0] for p in pairs]
        grp.ids = [p[1] for p in pairs]
        grp.seeds = np.array([mix64(seed64(m)) for m in grp.members], dtype=np.uint64)
        self._sizes[g] += 1
        self._order_cache.clear()

    def remove(self, name: str) -> None:
        g = self._group_of.pop(name, None)
        if g is None:
            return
        grp = self._groups[g]
        i = grp.members.index(name)
        del grp.members[i], grp.ids[i]
        grp.seeds = np.delete(grp.seeds, i)
        self._sizes[g] -= 1
        if not grp.members:
            del self._groups[g]
        self._order_cache.clear()

    def _group_order(self, key: str, key_seed: int) -> tuple[int, ...]:
        order = self._order_cache.get(key)
        if order is None:
            w = group_weights(key_seed, self._salt_arr, self._sizes)
            order = tuple(np.argsort(w, kind="stable")[::-1][: len(self._groups)].tolist())
            if len(self._order_cache) >= self.max_cached_keys:
                self._order_cache.clear()
            self._order_cache[key] = order
        return order

    def walk(self, key: str) -> Iterator[int]:
        """Replica ids in the key's order, lazily: stop iterating once you have enough."""
        key_seed = seed64(key)
        km = np.uint64(mix64(key_seed))
        for g in self._group_order(key, key_seed):
            grp = self._groups[g]
            if len(grp.ids) == 1:
                yield grp.ids[0]
                continue
            ids = grp.ids
            for j in np.argsort(_member_weights(km, grp.seeds), kind="stable")[::-1].tolist():  # type: ignore[arg-type]
                yield ids[j]

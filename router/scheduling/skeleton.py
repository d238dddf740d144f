"""Two-level (skeleton) rendezvous order: a key's first k replicas without ranking every replica.

Plain rendezvous hashing ranks all n replicas per key. Here replicas fall into `GROUPS` fixed groups
(by a hash of their name); a key ranks the groups by weighted rendezvous (weight = the group's size,
so each replica is any key's first choice with probability 1/n), then the members of a group by
plain rendezvous. The order is: the best group's members best first, then the next group's, and so
on. The groups are ranked for the key's slot (its hash modulo `SLOTS`), not the key itself: keys of
a slot share a group ranking, and every slot's is ranked at once after churn, so a key never seen
before costs no group ranking. Finding the first k costs a table lookup plus one ranking of a group's
members (~n / `GROUPS`), and churn moves few keys: a replica joining or leaving changes its own
group's weight and members only.

`skeleton_order` is the plain O(n) definition (the reference); `SkeletonRing` keeps the groups as
replicas come and go and walks a key's order lazily. Both use the same 64-bit hashes (blake2b of the
key and of the name, spread by the splitmix64 finaliser and combined by a multiply; a slot's group
weights come from one table, `log_uniforms`), so every router process agrees.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

GROUPS = 32
SLOTS = 1 << 14  # group rankings, one per slot: each group's share of first choices within ~1% of its size's
_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GROUP_SALT = 0x5EED5EED5EED5EED
_SLOT_SALT = 0x5107510751075107


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
    """Rendezvous weight of a node within its group: both sides already mixed, so one multiply
    spreads their combination into the high bits, which decide the order (`SkeletonRing.walk`
    inlines it)."""
    return ((key_mix ^ node_mix) * _C2) & _M


def _pair_hashes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    z = (a ^ b) * _U_C2
    return z ^ (z >> _U29)


def group_of(name: str, groups: int = GROUPS) -> int:
    return seed64(name) % groups


def _salts(groups: int) -> np.ndarray:
    return np.array([mix64(mix64(_GROUP_SALT + g)) for g in range(groups)], dtype=np.uint64)


def slot_of(key_seed: int) -> int:
    return key_seed % SLOTS


@functools.cache
def log_uniforms(groups: int) -> np.ndarray:
    """ln(u) for every (slot, group), u uniform in (0, 1) from their hash: [SLOTS, groups], 8 × groups
    × SLOTS bytes, computed once per process (the part of a group ranking that churn never changes)."""
    slots = _mix64_np(np.arange(SLOTS, dtype=np.uint64) + np.uint64(_SLOT_SALT))
    z = _pair_hashes(slots[:, None], _salts(groups)[None, :]) >> _U11
    return np.log(z.astype(np.float64) + 0.5) - _LN_2_53  # < 0: z + 0.5 < 2 ** 53


def inverse_sizes(sizes: np.ndarray) -> np.ndarray:
    """1 / size per group, inf for an empty one (its weight is then -inf)."""
    return np.where(sizes > 0, 1.0 / np.maximum(sizes, 1.0), np.inf)


def group_weights(slot: int, inverse: np.ndarray) -> np.ndarray:
    """Weighted rendezvous over all groups at once, as ln(u) / size (larger is better; the same order
    as size / -ln(u)), u uniform in (0, 1) per (slot, group); -inf for an empty group. `inverse`:
    `inverse_sizes` of the group sizes.

    Always over the full fixed-length arrays, so the reference and the ring compute the same floats.
    """
    return log_uniforms(len(inverse))[slot] * inverse


def skeleton_order(key: str, names: Iterable[str], groups: int = GROUPS) -> list[str]:
    """`names` from most to least preferred for `key` (O(n log n): the definition, for tests)."""
    names = list(names)
    k = seed64(key)
    km = mix64(k)
    sizes: np.ndarray = np.zeros(groups, dtype=np.float64)
    for n in names:
        sizes[group_of(n, groups)] += 1
    gw = group_weights(slot_of(k), inverse_sizes(sizes)).tolist()
    return sorted(
        names,
        key=lambda n: (gw[group_of(n, groups)], group_of(n, groups), member_weight(km, mix64(seed64(n))), n),
        reverse=True,
    )


@functools.cache
def _lanes(n: int) -> tuple[int, struct.Struct]:
    """(1 in each of n 128-bit lanes, the format that reads each lane's low 64 bits)."""
    return sum(1 << (128 * j) for j in range(n)), struct.Struct("<" + "Q8x" * n)


@dataclass(slots=True)
class _Group:
    members: list[str] = field(default_factory=list)  # sorted by name
    ids: list[int] = field(default_factory=list)  # caller's replica ids, aligned with members
    seeds: list[int] = field(default_factory=list)  # mix64(seed64(name)), aligned with members
    packed: int = 0  # the seeds, seed j in bits [128 j, 128 j + 64): see `SkeletonRing.ranked`

    def set_members(self, pairs: list[tuple[str, int]]) -> None:
        self.members = [p[0] for p in pairs]
        self.ids = [p[1] for p in pairs]
        self.seeds = [mix64(seed64(m)) for m in self.members]
        self.packed = sum(seed << (128 * j) for j, seed in enumerate(self.seeds))


@dataclass(slots=True)
class SkeletonRing:
    """The groups, kept as replicas are added and removed; `walk(key)` yields ids in `skeleton_order`."""

    groups: int = GROUPS
    _groups: dict[int, _Group] = field(default_factory=dict)
    _group_of: dict[str, int] = field(default_factory=dict)
    _sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    _inverse: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))  # inverse_sizes
    # every slot's group order, best first: `groups present` bytes per slot, all slots ranked at
    # once at the first walk after churn; None: churn since
    _order_table: bytes | None = None
    _order_width: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.groups <= 256:
            raise ValueError("groups: 1 to 256 (a slot's group order is kept as bytes)")
        self._sizes = np.zeros(self.groups, dtype=np.float64)
        self._inverse = inverse_sizes(self._sizes)

    def __len__(self) -> int:
        return len(self._group_of)

    def add(self, name: str, ident: int) -> None:
        if name in self._group_of:
            return
        g = group_of(name, self.groups)
        self._group_of[name] = g
        grp = self._groups.setdefault(g, _Group())
        grp.set_members(sorted([*zip(grp.members, grp.ids, strict=True), (name, ident)]))
        self._sizes[g] += 1
        self._inverse = inverse_sizes(self._sizes)
        self._order_table = None

    def remove(self, name: str) -> None:
        g = self._group_of.pop(name, None)
        if g is None:
            return
        grp = self._groups[g]
        i = grp.members.index(name)
        grp.set_members([p for j, p in enumerate(zip(grp.members, grp.ids, strict=True)) if j != i])
        self._sizes[g] -= 1
        self._inverse = inverse_sizes(self._sizes)
        if not grp.members:
            del self._groups[g]
        self._order_table = None

    def _group_order(self, slot: int) -> bytes:
        table = self._order_table
        if table is None:
            # All slots at once (~12 ms for 16,384 × 32): a key in a slot not seen since the last
            # churn, as most cold keys are on a large catalog, then costs a slice. Row by row the
            # same floats and the same stable sort as `group_weights(slot, ...)`; kept as bytes (a
            # group is < 256), one object for the collector, none of numpy's calls in a walk.
            w = log_uniforms(self.groups) * self._inverse
            width = self._order_width = len(self._groups)
            order = w.argsort(axis=1, kind="stable")[:, ::-1][:, :width]
            table = self._order_table = order.astype(np.uint8).tobytes()
        width = self._order_width
        return table[slot * width : (slot + 1) * width]

    def key_order(self, key: str) -> tuple[int, bytes]:
        """(the key's mixed seed, its slot's group order best first): what `walk` and `ranked` need."""
        key_seed = seed64(key)
        return mix64(key_seed), self._group_order(slot_of(key_seed))

    def ranked(self, key_mix: int, g: int) -> Iterator[int]:
        """Group `g`'s replica ids, best first for the key whose mixed seed is `key_mix`, lazily.

        `member_weight` of every member at once, in three operations on one integer: the members'
        seeds sit in 128-bit lanes, so xor-ing the key into every lane and one multiply by `_C2`
        give each lane (key_mix ^ seed) * _C2 with no carry into the next (a 64-bit by 64-bit
        product fits in 128 bits), and each lane's low 64 bits are the weight. As fast as the
        arithmetic in numpy, without numpy's calls, which a walk (rare on a large catalog: a cold
        adapter) finds out of the CPU's caches. Distinct seeds give distinct weights (xor with the
        key, then a multiply by an odd constant, are bijections mod 2 ** 64): no ties."""
        grp = self._groups[g]
        ids = grp.ids
        n = len(ids)
        if n == 1:
            return iter(ids)
        ones, lanes = _lanes(n)
        w = lanes.unpack(((grp.packed ^ key_mix * ones) * _C2).to_bytes(16 * n, "little"))
        return map(ids.__getitem__, sorted(range(n), key=w.__getitem__, reverse=True))

    def walk(self, key: str) -> Iterator[int]:
        """Replica ids in the key's order, lazily: stop iterating once you have enough."""
        km, order = self.key_order(key)
        for g in order:
            yield from self.ranked(km, g)

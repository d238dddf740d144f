"""Single flight for adapter loads across router processes: a Redis lease per (replica, adapter).

Each router process joins concurrent loads of one adapter on one replica (loader.py); several
routers behind one Service would still each post their own load. Before posting, a router takes
`{p}:loadlease:{replica}:{adapter}` (SET NX, expiring after the load timeout). The one that gets it
loads; the others poll the key until it says `loaded` (the holder's load finished: they count the
adapter resident without loading it) or is gone (the holder's load failed, the holder died, or its
lease ran out: they try to take it themselves). After a load the holder leaves `loaded` for
`LOADED_TTL_S`, so the requests of routers that come a little late join it too; an unload through
any router deletes it.

Fail-open: a Redis error or an open breaker makes `claim` answer "no lease" and the caller loads on
its own, as without Redis (the in-process single flight still holds). A worker evicting the adapter
on its own within `LOADED_TTL_S` of the load is not seen here: a request routed on the marker meets
the worker's 404 and is retried like any stale residency.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from lorafleet.breaker import CircuitBreaker

T = TypeVar("T")

LOADED = "loaded"
LOADED_TTL_S = 5.0
POLL_S = 0.05

# Replace the lease by an outcome only while it is still ours (it may have expired and been taken).
_FINISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
"""
_FORGET = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LoadLeases:
    """`client`: the router's `redis.asyncio.Redis` (decode_responses); `breaker`: its shared breaker."""

    def __init__(self, client, breaker: CircuitBreaker | None, prefix: str = "lorafleet",
                 poll_s: float = POLL_S, loaded_ttl_s: float = LOADED_TTL_S) -> None:
        self._r = client
        self._breaker = breaker
        self._p = prefix
        self.poll_s = poll_s
        self.loaded_ttl_s = loaded_ttl_s

    def key(self, replica: str, adapter: str) -> str:
        return f"{self._p}:loadlease:{replica}:{adapter}"

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await (fn() if self._breaker is None else self._breaker.call(fn))

    async def claim(self, replica: str, adapter: str, ttl_s: float) -> str | None:
        """`LOADED` when another router loaded the adapter on the replica meanwhile; otherwise a
        lease token (this router loads, then calls `finish`), or None when Redis cannot say
        (this router loads without a lease). Waits while another router's load is under way."""
        key = self.key(replica, adapter)
        token = uuid.uuid4().hex
        ttl_ms = max(1, int(ttl_s * 1000))
        deadline = time.monotonic() + ttl_s + 1.0
        while time.monotonic() < deadline:
            try:
                if await self._call(lambda: self._r.set(key, token, nx=True, px=ttl_ms)):
                    return token
                state = await self._call(lambda: self._r.get(key))
            except Exception:  # Redis unwell or the breaker open: fail open, load here
                return None
            if state == LOADED:
                return LOADED
            await asyncio.sleep(self.poll_s)
        return None

    async def finish(self, replica: str, adapter: str, token: str, loaded: bool) -> None:
        """Mark the holder's load done (`loaded`, for a short while) or failed (the lease goes, so
        a waiting router tries the load itself). Best effort: an unanswered call leaves the lease
        to expire."""
        outcome = LOADED if loaded else ""
        ttl_ms = str(max(1, int(self.loaded_ttl_s * 1000)))
        try:
            await self._call(lambda: self._r.eval(_FINISH, 1, self.key(replica, adapter), token, outcome, ttl_ms))
        except Exception:
            return

    async def forget(self, replica: str, adapter: str) -> None:
        """The adapter was unloaded from the replica: a `loaded` marker no longer holds (a lease
        of a load under way stays)."""
        try:
            await self._call(lambda: self._r.eval(_FORGET, 1, self.key(replica, adapter), LOADED))
        except Exception:
            return

"""The cross-router load lease (router/load_lease.py) on the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest

from lorafleet.breaker import CircuitBreaker
from lorafleet.router.load_lease import LOADED, LoadLeases


def _redis_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
async def client():
    if not _redis_answers():
        pytest.skip("no Redis answers on 127.0.0.1:6379")
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    prefix = f"lftest-{uuid.uuid4().hex[:8]}"
    yield r, prefix
    keys = [k async for k in r.scan_iter(f"{prefix}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


async def test_one_holder_the_others_wait_for_loaded(client):
    r, prefix = client
    routers = [LoadLeases(r, None, prefix, poll_s=0.01) for _ in range(3)]
    first = await routers[0].claim("w0", "c", 5.0)
    assert first not in (None, LOADED)
    waiting = [asyncio.create_task(lease.claim("w0", "c", 5.0)) for lease in routers[1:]]
    await asyncio.sleep(0.1)
    assert not any(t.done() for t in waiting)  # they wait while the holder loads
    await routers[0].finish("w0", "c", first, loaded=True)
    assert await asyncio.wait_for(asyncio.gather(*waiting), 2) == [LOADED, LOADED]
    # A late router within the marker's lifetime joins too; another replica or adapter is its own lease.
    assert await routers[1].claim("w0", "c", 5.0) == LOADED
    assert await routers[1].claim("w1", "c", 5.0) not in (None, LOADED)
    assert await routers[1].claim("w0", "d", 5.0) not in (None, LOADED)


async def test_a_failed_load_hands_the_lease_on(client):
    r, prefix = client
    a, b = LoadLeases(r, None, prefix, poll_s=0.01), LoadLeases(r, None, prefix, poll_s=0.01)
    token = await a.claim("w0", "c", 5.0)
    waiter = asyncio.create_task(b.claim("w0", "c", 5.0))
    await asyncio.sleep(0.05)
    await a.finish("w0", "c", token, loaded=False)
    taken = await asyncio.wait_for(waiter, 2)
    assert taken not in (None, LOADED, token)  # b loads it now, under its own lease


async def test_an_expired_lease_is_taken_over_and_the_old_holder_cannot_overwrite(client):
    r, prefix = client
    a, b = LoadLeases(r, None, prefix, poll_s=0.01), LoadLeases(r, None, prefix, poll_s=0.01)
    stale = await a.claim("w0", "c", 0.2)  # its holder dies: nobody finishes it
    taken = await asyncio.wait_for(b.claim("w0", "c", 5.0), 2)
    assert taken not in (None, LOADED, stale)
    await a.finish("w0", "c", stale, loaded=True)  # too late: b holds it
    assert await r.get(a.key("w0", "c")) == taken


async def test_unload_forgets_loaded_but_not_a_load_under_way(client):
    r, prefix = client
    lease = LoadLeases(r, None, prefix, poll_s=0.01)
    token = await lease.claim("w0", "c", 5.0)
    await lease.forget("w0", "c")
    assert await r.get(lease.key("w0", "c")) == token
    await lease.finish("w0", "c", token, loaded=True)
    await lease.forget("w0", "c")
    assert await r.get(lease.key("w0", "c")) is None


async def test_redis_down_or_breaker_open_means_no_lease():
    import redis.asyncio as aioredis

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.2,
                                   decode_responses=True)
    breaker = CircuitBreaker("redis", timeout_s=0.5, failures_to_open=1, cooldown_s=60)
    lease = LoadLeases(dead, breaker, "lftest")
    assert await lease.claim("w0", "c", 5.0) is None  # the failure opens the breaker
    assert breaker.is_open
    assert await lease.claim("w0", "c", 5.0) is None  # and then Redis is not asked at all
    await lease.finish("w0", "c", "t", loaded=True)  # best effort: no error
    await lease.forget("w0", "c")
    await breaker.aclose()
    await dead.aclose()

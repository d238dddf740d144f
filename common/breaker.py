"""A circuit breaker for calls to a shared service (Redis) that may hang rather than fail.

A dead Redis refuses connections at once; a hung one (SIGSTOP, a full network buffer, a failover)
accepts them and never answers, so every call waits for its timeout. The breaker bounds that:

- closed: calls run, each under `timeout_s`. `failures_to_open` failures in a row (a timeout, or an
  exception `is_failure` accepts) open it.
- open: calls raise `BreakerOpen` at once, without touching the service; the caller takes its
  fallback. After `cooldown_s` the breaker goes half-open.
- half-open: calls still fail fast, and one background probe (`probe()`, under `timeout_s`) runs;
  it succeeding closes the breaker, failing re-opens it for another cooldown. No request ever
  waits on a probe.

`on_change(state, why)` is told of every transition (metrics, a log line). One breaker per service:
every client of that Redis shares it, so the first few failures anywhere open it for all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class BreakerOpen(Exception):
    """The breaker is open: the call was not made."""


def _any_error(_exc: BaseException) -> bool:
    return True


@dataclass(slots=True)
class CircuitBreaker:
    name: str
    timeout_s: float = 0.1
    failures_to_open: int = 3
    cooldown_s: float = 1.0
    probe: Callable[[], Awaitable[object]] | None = None
    on_change: Callable[[str, str], None] | None = None
    # Exceptions that count against the service (its errors, timeouts); others (a caller's own
    # refusal raised inside the call, e.g. a rate limit reached) mean the service answered.
    is_failure: Callable[[BaseException], bool] = _any_error
    clock: Callable[[], float] = time.monotonic
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0
    _probe_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def is_open(self) -> bool:
        return self.state != CLOSED

    async def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float | None = None) -> T:
        """`fn()` under the timeout; `BreakerOpen` without calling it while open or half-open."""
        if self.state != CLOSED:
            self._maybe_probe()
            raise BreakerOpen(f"{self.name}: circuit breaker open")
        try:
            result = await asyncio.wait_for(fn(), self.timeout_s if timeout_s is None else timeout_s)
        except asyncio.TimeoutError:
            self._failed(f"a call took longer than {timeout_s or self.timeout_s:g}s")
            raise
        except Exception as exc:
            if self.is_failure(exc):
                self._failed(f"{type(exc).__name__}")
            else:
                self.failures = 0
            raise
        self.failures = 0
        return result

    def _failed(self, why: str) -> None:
        if self.state != CLOSED:
            return
        self.failures += 1
        if self.failures >= self.failures_to_open:
            self._open(f"{self.failures} failures in a row, the last: {why}")

    def _open(self, why: str) -> None:
        self.state = OPEN
        self.opened_at = self.clock()
        self._notify(OPEN, why)

    def _close(self, why: str) -> None:
        self.state = CLOSED
        self.failures = 0
        self._notify(CLOSED, why)

    def _notify(self, state: str, why: str) -> None:
        if self.on_change is not None:
            self.on_change(state, why)

    def _maybe_probe(self) -> None:
        if self.state != OPEN or self.clock() - self.opened_at < self.cooldown_s:
            return
        self.state = HALF_OPEN
        self._notify(HALF_OPEN, f"probing after {self.cooldown_s:g}s open")
        if self.probe is None:  # nothing to probe with: let calls through again
            self._close("no probe configured: calls resume")
            return
        self._probe_task = asyncio.get_running_loop().create_task(self._run_probe())

    async def _run_probe(self) -> None:
        assert self.probe is not None
        try:
            await asyncio.wait_for(self.probe(), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure keeps it open
            self._open(f"probe failed ({type(exc).__name__})")
            return
        self._close("probe answered")

    async def aclose(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)

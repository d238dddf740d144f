"""Adapter loads and unloads on replicas, single flight per (replica, adapter).

A request for a cold adapter waits here until the load finishes or `timeout_s` passes; concurrent
requests for the same adapter on the same replica share one load. The worker's answer is trusted
only for what it says: 200, or vLLM's 400 "already loaded", count as loaded.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from lorafleet.placement_store import replica_key
from lorafleet.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from lorafleet.router.admin_tokens import AdminTokens
from lorafleet.router.fleet import Replica
from lorafleet.router.load_lease import LOADED, LoadLeases
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.placement import PlacementSync
from lorafleet.router.worker_kinds import still_listed

log = logging.getLogger("lorafleet.router")


class LoadFailed(Exception):
    """A load that did not happen. Only `replica_fault` says anything about the replica's health
    (its admin API unreachable, a connection broken, a 5xx); an adapter it refuses, one the
    catalog lacks, or a load slower than the wait is the adapter's or the load's, not the replica's.

    The message reaches clients (in the router's 503): it never carries the worker's error text,
    which names the adapter's files; `detail` has that, for the router's log only."""

    def __init__(self, message: str, unreachable: bool = False, replica_fault: bool = False,
                 detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message
        self.unreachable = unreachable
        self.replica_fault = replica_fault or unreachable


class AdapterLoader:
    def __init__(
        self,
        http: httpx.AsyncClient,
        sync: PlacementSync,
        metrics: RouterMetrics,
        catalog: dict[str, str],
        tokens: AdminTokens,
        timeout_s: float,
        leases: LoadLeases | None = None,
    ) -> None:
        self.http = http
        # Across router processes: one load per (replica, adapter) through a Redis lease (load_lease.py).
        self.leases = leases
        self.sync = sync
        self.metrics = metrics
        self.catalog = catalog
        self.timeout_s = timeout_s
        self.tokens = tokens
        self.loads_started = 0

    def can_load(self, adapter: str) -> bool:
        return adapter in self.catalog

    async def ensure(self, replica: Replica, adapters: tuple[str, ...]) -> None:
        """Wait until every adapter is loaded on `replica` (joining loads under way)."""
        waits = []
        for name in adapters:
            future = replica.loading.get(name)
            if future is None:
                if name in replica.residency():
                    continue
                future = asyncio.get_running_loop().create_future()
                replica.loading[name] = future
                replica.touch()  # a request joins a load under way: the replica counts as holding it
                asyncio.get_running_loop().create_task(self._load(replica, name, future))
            waits.append(future)
        if not waits:
            return
        gathered = asyncio.gather(*(asyncio.shield(w) for w in waits))
        # A waiter cancelled (its client left) leaves the gather's CancelledError unread under
        # Python 3.11's wait_for, which asyncio would log as an error: read it here.
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait_for(gathered, self.timeout_s)
        except asyncio.TimeoutError as exc:
            raise LoadFailed(f"adapter load on {replica.name} took longer than {self.timeout_s:g}s") from exc

    async def _load(self, replica: Replica, name: str, future: asyncio.Future[None]) -> None:
        try:
            unloading = replica.unloading.get(name)
            if unloading is not None:
                await asyncio.shield(unloading)
            path = self.catalog.get(name)
            if path is None:
                raise LoadFailed(f"adapter {name!r} is not in the catalog")
            # Another router's load of it under way: wait for that one (LOADED) instead of posting ours.
            lease_key, token = replica_key(self.sync.scope, replica.name), None
            if self.leases is not None:
                token = await self.leases.claim(lease_key, name, self.timeout_s)
            if token != LOADED:
                self.loads_started += 1
                self.metrics.cold_loads.labels(replica.name).inc()
                try:
                    await self._post_load(replica, name, path)
                except BaseException:
                    if token is not None:
                        await self.leases.finish(lease_key, name, token, False)
                    raise
            await self.sync.write_through(replica, name, "cpu")
            if token is not None and token != LOADED:
                await self.leases.finish(lease_key, name, token, True)
            future.set_result(None)
            if name in replica.transient and replica.inflight_by_adapter.get(name, 0) == 0:
                # A scratch-slot copy whose requests all left while it loaded (their clients went
                # away, their wait timed out): nothing will release it, so give the slot back now.
                replica.transient.discard(name)
                asyncio.get_running_loop().create_task(self.unload(replica, name))
        except Exception as exc:
            replica.transient.discard(name)  # not loaded: nothing of this load's to unload later
            self.metrics.load_failures.labels(replica.name).inc()
            log.warning("%s", exc.detail if isinstance(exc, LoadFailed) else repr(exc))
            future.set_exception(exc if isinstance(exc, LoadFailed) else LoadFailed(
                f"load of {name!r} on {replica.name} failed ({type(exc).__name__})", detail=repr(exc)))
            future.exception()  # mark retrieved: waiters may have timed out already
        finally:
            replica.loading.pop(name, None)
            replica.touch()

    async def _post_load(self, replica: Replica, name: str, path: str) -> None:
        """Ask the worker to load; `LoadFailed` unless it did (or already had the adapter)."""
        body = LoadLoraAdapterRequest(lora_name=name, lora_path=path).model_dump(exclude_defaults=True)
        try:
            resp = await self.http.post(
                f"{replica.admin_url}/v1/load_lora_adapter",
                json=body,
                headers=self.tokens.headers(replica.pool),
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            slow = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
            raise LoadFailed(
                f"load on {replica.name}: {type(exc).__name__}", unreachable=isinstance(exc, httpx.ConnectError),
                replica_fault=not slow, detail=f"load on {replica.name}: {exc!r}",
            ) from exc
        if resp.status_code != 200 and not (resp.status_code == 400 and "already" in resp.text.lower()):
            raise LoadFailed(
                f"load of {name!r} on {replica.name}: HTTP {resp.status_code}{_reason(resp)}",
                replica_fault=resp.status_code >= 500,
                detail=f"load of {name!r} on {replica.name}: HTTP {resp.status_code} {resp.text[:200]}",
            )

    async def unload(self, replica: Replica, name: str) -> None:
        """Best effort: a failed unload leaves the worker's own LRU to reclaim the slot.

        The adapter stops counting as resident when the unload starts, not when it is done: a
        request routed there meanwhile would reach a worker that is dropping it (a 404). A load of
        the same adapter waits for the unload (`_load`), so the two never race on the worker.
        """
        done = asyncio.get_running_loop().create_future()
        previous = replica.unloading.get(name)
        replica.unloading[name] = done
        replica.note(name, None, self.sync.fleet.clock())
        try:
            if previous is not None:
                await asyncio.shield(previous)
            body = UnloadLoraAdapterRequest(lora_name=name).model_dump(exclude_none=True)
            try:
                resp = await self.http.post(
                    f"{replica.admin_url}/v1/unload_lora_adapter",
                    json=body,
                    headers=self.tokens.headers(replica.pool),
                    timeout=10.0,
                )
            except httpx.HTTPError:
                return
            if resp.status_code == 200 and replica.kind == "vllm" and await still_listed(
                    self.http, replica.admin_url, self.tokens.headers(replica.pool), name):
                log.warning("unload of %r on %s answered 200 but vLLM still lists it", name, replica.name)
                return  # the next poll shows it resident again
            if resp.status_code in (200, 404):
                self.metrics.unloads.labels(replica.name).inc()
                await self.sync.write_through(replica, name, None)
                if self.leases is not None:
                    await self.leases.forget(replica_key(self.sync.scope, replica.name), name)
        finally:
            done.set_result(None)
            if replica.unloading.get(name) is done:
                del replica.unloading[name]


def _reason(resp: httpx.Response) -> str:
    """The worker's machine-readable refusal reason (`error.reason`, e.g. `path_outside_root`), safe
    to show; its message is not (it names files)."""
    try:
        reason = resp.json()["error"].get("reason")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""
    return f" ({reason})" if isinstance(reason, str) and reason.isidentifier() else ""

"""How a changed adapter reaches the workers (mixed into `PoolReconciler`): its copies are brought
to the record's target content in place, one canary copy first; a copy kept busy is replaced only
once the target serves elsewhere (make before break); content the workers refuse, or without the
spec's sha256, leaves the previous version serving (`AdapterRecord.update_refused`) and is probed
again under a scratch name with backoff. The records and the pure judgements (`stale_copies`,
`serving_version`, `sync_verified`) are in `pool_state`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from lorafleet.operator import pool_state
from lorafleet.operator.pool_state import AdapterRecord
from lorafleet.operator.sources import load_pin
from lorafleet.operator.spec import digest_matches, same_digest
from lorafleet.operator.worker_client import LoadRefused, WorkerBusy, WorkerError, fetch_retry, resident
from lorafleet.protocol import AdapterInfo, AdapterInventory

if TYPE_CHECKING:
    from collections.abc import Callable

    from lorafleet.operator.pool_state import PodState, ReconcilerSettings, UrlOf
    from lorafleet.operator.spec import AdapterSpec, PoolSpec
    from lorafleet.operator.worker_client import WorkerClient

# The scratch name a refused update's content is probed under: `_` is in no Kubernetes object name,
# so no LoraAdapter can have it.
PROBE_SUFFIX = "__lorafleet_probe"

log = logging.getLogger("lorafleet.operator")


class Rollout:
    """The rollout half of `PoolReconciler`; every attribute is the reconciler's."""

    __slots__ = ()
    if TYPE_CHECKING:
        pool: PoolSpec | None
        token: str | None
        workers: WorkerClient
        settings: ReconcilerSettings
        url_of: UrlOf
        clock: Callable[[], float]
        adapters: dict[str, AdapterRecord]
        pods: dict[str, PodState]
        inventories: dict[str, AdapterInventory]
        loaded: dict[str, set[str]]
        digests: dict[str, str]
        _spares: set[tuple[str, str]]

        def _source_path(self, spec: AdapterSpec) -> str: ...
        def _note_copy(self, pod: str, inventory: AdapterInventory, name: str) -> None: ...
        async def _record_residency(self, pod: str, adapter: str, tier: str | None) -> None: ...

    def _target_path(self, record: AdapterRecord) -> str:
        """Where copies of the record's target come from: the serving version's path while an
        update is refused, else the spec's source."""
        return record.serving_path or self._source_path(record.spec)  # set exactly while an update is refused

    def _pin(self, record: AdapterRecord) -> str | None:
        """The digest a load of the record's target must have (operator/sources.py `load_pin`)."""
        assert self.pool is not None
        return load_pin(record.spec.sha256, record.spec.source, record.target_digest, self.pool.server.kind)

    def _copies(self, name: str, skip: str | None = None) -> list[AdapterInfo]:
        return [a for pod, inv in self.inventories.items() if pod != skip for a in inv.adapters if a.name == name]

    def _adopt(self, record: AdapterRecord, pod: str, inventory: AdapterInventory, before: AdapterInfo | None) -> None:
        """Judge a copy this operator just loaded (or reloaded) from the record's target path.

        The spec's content without the spec's sha256 while another version is listed (this pod's
        copy before the reload, or any other pod's): that version keeps serving and the update is
        refused (DigestMismatch); no other version anywhere: the copy is verified and
        `check_loaded` fails the adapter, a first version of the wrong content being served nowhere."""
        digest = pool_state.copy_digest(inventory, record.spec.name)
        if digest is None:
            return
        if record.update_refused:  # a copy of the serving version, unless a concurrent load took refused content
            if same_digest(digest, record.serving_digest):
                record.verified[pod] = digest
            return
        if not digest_matches(record.spec.sha256, digest):
            others = self._copies(record.spec.name, skip=pod)
            expected = record.expected_digest
            if expected is not None and any(same_digest(c.digest, expected) for c in others):
                # The spec's content serves elsewhere: this worker's volume gives other bytes.
                log.warning("%s on worker %s is %s, not the spec's sha256 as elsewhere: not verified", record.spec.name,
                            pod, digest)
                return
            version = pool_state.serving_version(record, ([before] if before is not None else []) + others)
            if version is not None:
                record.refuse_update("DigestMismatch", _mismatch(record, digest, pod), version.path, version.digest,
                                     self.clock())
                log.warning("update of %s: %s; %s keeps serving", record.spec.name, record.update_refused[1], version.path)
                return
        record.verified[pod] = digest
        record.current_digest = digest

    async def _reload(self, copies: set[tuple[str, str]]) -> int:
        """Bring copies to the record's target in place (a new source or sha256, or back to the
        serving version after a refused update): the worker swaps the weights once no request runs
        on them, so the adapter never leaves the worker. One copy of each adapter goes first (a
        canary): the others follow in the same round only if it took. A copy kept busy past
        `reload_grace_s` is drained instead (`_drain`). Returns the transient errors."""
        assert self.pool is not None and self.token is not None
        pool, token = self.pool, self.token
        errors = 0
        locks: dict[str, asyncio.Lock] = {}

        async def one(pod_name: str, name: str) -> bool:
            nonlocal errors
            pod, record = self.pods.get(pod_name), self.adapters.get(name)
            if pod is None or pod.ip is None or record is None or record.problem is not None:
                return False
            url = self.url_of(pod, pool.admin_port)
            async with locks.setdefault(pod_name, asyncio.Lock()):  # each answer replaces the pod's inventory
                before = pool_state.info_of(self.inventories.get(pod_name), name)
                refused_before = record.update_refused
                try:
                    inv = await self.workers.load(url, token, name, self._target_path(record), inplace=True,
                                                  sha256=self._pin(record))
                except LoadRefused as exc:  # the new version is unusable: the old one keeps serving
                    return await self._refused(record, exc, url, pod_name)
                except WorkerBusy as exc:  # requests still run on the old weights
                    errors += 1
                    since = record.busy_since.setdefault(pod_name, self.clock())
                    if self.clock() - since < self.settings.reload_grace_s:
                        log.info("reload of %s on %s: %s", name, pod_name, exc)
                    elif self._target_elsewhere(record, pod_name):
                        await self._drain(url, pod_name, name)
                    else:  # make before break: the target on another worker first, judged there
                        await self._load_spare(record, pod_name)
                    return False
                except WorkerError as exc:
                    errors += 1
                    record.fetch_retrying = fetch_retry(exc) or record.fetch_retrying
                    log.info("reload of %s on %s: %s", name, pod_name, exc)
                    return False
                record.busy_since.pop(pod_name, None)
                self.inventories[pod_name] = inv
                self.loaded[pod_name] = resident(inv)
                pool_state.note_digests(self.digests, inv)
                self._adopt(record, pod_name, inv, before)
                return record.update_refused == refused_before and record.problem is None

        async def adapter(name: str, pods: list[str]) -> None:
            canary, *rest = pods
            if await one(canary, name):
                await asyncio.gather(*(one(pod_name, name) for pod_name in rest))

        by_adapter: dict[str, list[str]] = {}
        for pod_name, name in sorted(copies):
            by_adapter.setdefault(name, []).append(pod_name)
        await asyncio.gather(*(adapter(name, pods) for name, pods in by_adapter.items()))
        return errors

    async def _probe_refused(self) -> int:
        """Try a refused update's content again, with backoff (30 s doubling to 10 min): the files
        may have been fixed in place under the same source and sha256. The probe loads it under a
        scratch name and unloads it again, so no serving copy ever holds content not yet judged."""
        assert self.pool is not None and self.token is not None
        now, errors = self.clock(), 0
        for record in list(self.adapters.values()):
            if not record.update_refused or record.problem is not None or now < record.next_probe:
                continue
            record.probe_delay = min(record.probe_delay * 2, 600.0)
            record.next_probe = now + record.probe_delay
            pod = next((self.pods[p] for p in sorted(self.inventories) if p in self.pods and self.pods[p].usable), None)
            if pod is None:
                continue
            try:
                digest = await self._scratch_digest(self.url_of(pod, self.pool.admin_port), record,
                                                    self._source_path(record.spec))
            except LoadRefused as exc:
                record.update_refused = (exc.reason, exc.message)
                continue
            except WorkerError as exc:
                errors += 1
                log.info("probe of %s's update on %s: %s", record.spec.name, pod.name, exc)
                continue
            if digest is not None and digest_matches(record.spec.sha256, digest):
                log.info("update of %s now loads (%s): rolling it out", record.spec.name, digest)
                record.accept_update()
                record.current_digest = digest  # the copies now differ from it: stale, reloaded
            elif digest is not None:
                record.update_refused = ("DigestMismatch", _mismatch(record, digest))
        return errors

    async def _scratch_digest(self, url: str, record: AdapterRecord, path: str) -> str | None:
        """Load `path` under the record's scratch name and unload it again (whatever happened): the
        digest the worker reported. A refusal or worker error is raised."""
        assert self.token is not None
        scratch = f"{record.spec.name}{PROBE_SUFFIX}"
        try:
            inv = await self.workers.load(url, self.token, scratch, path, inplace=True)
        finally:
            with contextlib.suppress(WorkerError):
                await self.workers.unload(url, self.token, scratch)
        return pool_state.copy_digest(inv, scratch)

    async def _judge_scratch(self, record: AdapterRecord, url: str, pod_name: str) -> bool:
        """Load the record's target under a scratch name on `pod_name` and unload it again: whether
        it loads with the spec's sha256. A refusal or another digest refuses the update (the copy
        there still serves the old version)."""
        try:
            digest = await self._scratch_digest(url, record, self._target_path(record))
        except LoadRefused as exc:
            await self._refused(record, exc, url, pod_name)
            return False
        except WorkerError as exc:
            log.info("trial load of %s on %s: %s", record.spec.name, pod_name, exc)
            return False
        if record.update_refused or digest is None or digest_matches(record.spec.sha256, digest):
            return True
        here = pool_state.info_of(self.inventories.get(pod_name), record.spec.name)
        if here is None:
            return True
        record.refuse_update("DigestMismatch", _mismatch(record, digest), here.path, here.digest, self.clock())
        return False

    async def _refused(self, record: AdapterRecord, exc: LoadRefused, url: str, pod_name: str) -> bool:
        """A worker refused the load; returns whether a rollout may go on to other copies.

        Of the serving version's own path (its files gone?): with no copy of the adapter left
        anywhere, the refusal is dropped and the spec tried afresh (a first load); else logged. Of
        the spec's content while it serves elsewhere: this worker's problem, logged. While the
        previous spec's version is listed: that version keeps serving, the update refused. Else
        Failed, as any refused first load."""
        assert self.token is not None
        name = record.spec.name
        try:  # what serves there now (the round's inventory may predate this round's loads)
            here = await self.workers.inventory(url, token=self.token)
        except WorkerError:
            here = self.inventories.get(pod_name)
        copies = [a for a in (here.adapters if here is not None else ()) if a.name == name] + self._copies(name, skip=pod_name)
        if record.update_refused:
            log.warning("load of %s from %s refused on %s: %s", name, record.serving_path, pod_name, exc.message)
            if not copies:
                record.accept_update()
            return False
        expected = record.expected_digest
        if expected is not None and any(same_digest(c.digest, expected) for c in copies):
            log.warning("load of %s refused on %s while the same content serves elsewhere: %s", name, pod_name, exc.message)
            record.replica_refused = (exc.reason, exc.message)
            mine = pool_state.info_of(here, name)
            if mine is not None and not same_digest(mine.digest, expected):  # e.g. a router's cold load of changed bytes
                await self._drain(url, pod_name, name)
            return True
        version = pool_state.serving_version(record, copies)
        if version is None:
            record.failure = (exc.reason, exc.message)
            return False
        record.refuse_update(exc.reason, exc.message, version.path, version.digest, self.clock())
        log.warning("update of %s refused on %s (%s); the version from %s keeps serving",
                    name, pod_name, exc.message, version.path)
        return False

    def _target_elsewhere(self, record: AdapterRecord, pod_name: str) -> bool:
        """Whether a resident copy of the record's target serves on another worker."""
        target = record.target_digest
        return any(pod in record.verified if target is None else pool_state.holds(inv, record.spec.name, target)
                   for pod, inv in self.inventories.items() if pod != pod_name)

    async def _load_spare(self, record: AdapterRecord, busy_pod: str) -> None:
        """The target on a worker that holds no copy (the fewest adapters first), so the busy one is
        drained only once the target serves (and is judged) elsewhere. A pool of one worker has no
        spare: the busy copy is drained, as before."""
        assert self.pool is not None and self.token is not None
        name = record.spec.name
        spares = sorted((len(inv.adapters), pod) for pod, inv in self.inventories.items()
                        if pod != busy_pod and pool_state.info_of(inv, name) is None and (p := self.pods.get(pod)) is not None
                        and p.usable)
        if not spares:  # no other worker to judge it on: judged under a scratch name first, then drained
            pod = self.pods.get(busy_pod)
            if pod is not None and pod.ip:
                url = self.url_of(pod, self.pool.admin_port)
                if await self._judge_scratch(record, url, busy_pod):
                    await self._drain(url, busy_pod, name)
            return
        spare = spares[0][1]
        url = self.url_of(self.pods[spare], self.pool.admin_port)
        log.info("%s busy on %s past the grace: loading the new version on %s first", name, busy_pod, spare)
        try:
            inv = await self.workers.load(url, self.token, name, self._target_path(record), inplace=True,
                                          sha256=self._pin(record))
        except LoadRefused as exc:
            await self._refused(record, exc, url, spare)
            return
        except WorkerError as exc:
            log.info("load of %s on %s: %s", name, spare, exc)
            return
        self._took(record, spare, inv, None)
        self._spares.add((spare, name))
        await self._record_residency(spare, name, "cpu")

    def _took(self, record: AdapterRecord, pod: str, inventory: AdapterInventory, before: AdapterInfo | None) -> None:
        """The bookkeeping after a load of the record's target on `pod` answered with `inventory`."""
        self.loaded.setdefault(pod, set()).add(record.spec.name)
        record.replica_refused = record.fetch_retrying = None
        self._note_copy(pod, inventory, record.spec.name)
        self._adopt(record, pod, inventory, before)
        pool_state.note_digests(self.digests, inventory)

    async def _drain(self, url: str, pod: str, name: str) -> None:
        """Unload an old version that never went idle: routers stop sending it here (withdrawn
        first; one on an older poll gets the worker's 404 and goes elsewhere), its running requests
        finish with the old weights, and the placement loads the new version (the worker answers
        `draining` until those requests end: retried)."""
        log.info("reload of %s on %s: busy for %.0f s; draining the old version", name, pod,
                 self.settings.reload_grace_s)
        try:
            await self._record_residency(pod, name, None)
            await self.workers.unload(url, self.token, name)
        except WorkerError as exc:
            log.info("drain of %s on %s: %s", name, pod, exc)
            return
        self.loaded.setdefault(pod, set()).discard(name)
        self._spares = {(p, n) for p, n in self._spares if n != name}  # the new version replaces it now
        record = self.adapters.get(name)
        if record is not None:
            record.busy_since.pop(pod, None)
            record.verified.pop(pod, None)


def _mismatch(record: AdapterRecord, digest: str, pod: str | None = None) -> str:
    where = f" on worker {pod}" if pod is not None else ""
    return f"{record.spec.source!r} gives {digest}{where}, the spec wants sha256:{record.spec.sha256}"

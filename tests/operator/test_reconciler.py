"""The reconcile loop against stub workers and a recording placement store (no HTTP, no kopf):
the order of store writes around loads and unloads, no flapping of copies in use, and old
versions (a source or sha256 changed) replaced in place."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from lorafleet.operator import placement, pool_state
from lorafleet.operator.pool_state import AdapterRecord, PodState, ReconcilerSettings
from lorafleet.operator.reconciler import PoolReconciler
from lorafleet.operator.spec import EngineSpec, PoolSpec, digest_matches, parse_adapter
from lorafleet.operator.worker_client import LoadRefused, WorkerBusy
from lorafleet.placement_store import MemoryPlacementStore
from lorafleet.protocol import AdapterInfo, AdapterInventory

NOW = 1_000_000.0
PODS = ("p0", "p1")


@dataclass(slots=True)
class StubWorkers:
    """`WorkerClient`'s interface over in-memory workers; a worker's URL is its pod's name."""

    events: list[tuple]
    held: dict[str, dict[str, AdapterInfo]] = field(default_factory=lambda: {p: {} for p in PODS})
    refuse: set[str] = field(default_factory=set)  # adapter names, or source paths, whose loads are refused
    broken: int = 0  # inventory calls left that raise what no worker client should (a bug)

    async def inventory(self, url: str, token: str) -> AdapterInventory:
        if self.broken > 0:
            self.broken -= 1
            raise RuntimeError("unforeseen")
        return AdapterInventory(
            model="base",
            max_loras=4,
            max_cpu_loras=8,
            max_lora_rank=64,
            max_loras_per_request=4,
            adapters=list(self.held[url].values()),
        )

    async def load(self, url: str, token: str, name: str, path: str, inplace: bool = False) -> AdapterInventory:
        old = self.held[url].get(name)
        self.events.append(("reload" if inplace and old is not None else "load", url, name))
        if name in self.refuse or path in self.refuse:
            raise LoadRefused(400, "not an adapter")
        new = info(name, path=path)
        if old is not None and old.digest != new.digest:
            if not inplace:
                raise LoadRefused(409, f"{name} is loaded with different content")
            if old.requests_in_flight:
                raise WorkerBusy("in_use", f"{name} has requests in flight")
        self.held[url][name] = new
        return await self.inventory(url, token)

    async def unload(self, url: str, token: str, name: str) -> AdapterInventory:
        self.events.append(("unload", url, name))
        self.held[url].pop(name, None)
        return await self.inventory(url, token)


class RecordingStore(MemoryPlacementStore):
    def __init__(self, events: list[tuple]) -> None:
        super().__init__()
        self.events = events

    async def record_residency(self, replica: str, adapter: str, tier: str | None, ttl_s: float) -> None:
        self.events.append(("store", replica, adapter, tier))
        await super().record_residency(replica, adapter, tier, ttl_s)


def digest_of(path: str) -> str:
    """The stub's content: one digest per source folder."""
    return "sha256:" + hashlib.sha256(path.encode()).hexdigest()


def info(name: str, last_used: float | None = None, in_flight: int = 0, idle_s: float | None = None,
         path: str | None = None, tier: str = "cpu") -> AdapterInfo:
    path = path or f"/adapters/{name}"
    return AdapterInfo(
        name=name,
        tier=tier,
        rank=8,
        alpha=16.0,
        digest=digest_of(path),
        path=path,
        requests_in_flight=in_flight,
        last_used=last_used,
        idle_s=idle_s,
    )


def make(adapters: dict[str, tuple[int, int]]) -> tuple[PoolReconciler, StubWorkers, list[tuple]]:
    events: list[tuple] = []
    workers = StubWorkers(events)
    reconciler = PoolReconciler(
        "ns",
        "pool",
        workers,
        None,
        RecordingStore(events),
        ReconcilerSettings(),  # type: ignore[arg-type]
        url_of=lambda pod, _port: pod.name,
        clock=lambda: NOW,
    )
    reconciler.set_pool(PoolSpec("ns", "pool", "img", "/model", "base"), "token")
    for pod in PODS:
        reconciler.observe_pod(PodState(pod, "10.0.0.1", ready=True, draining=False))
    for name, (lo, hi) in adapters.items():
        spec = parse_adapter("ns", name, {"pool": "pool", "source": name, "replicas": {"min": lo, "max": hi}})
        reconciler.upsert_adapter(spec, 1, None)
    return reconciler, workers, events


def home_and_other(name: str) -> tuple[str, str]:
    views = [placement.PodView(p, 8) for p in PODS]
    (home,) = placement.assign([placement.AdapterWant(name)], views).pods[name]
    return home, next(p for p in PODS if p != home)


async def test_an_unload_withdraws_the_residency_from_the_store_first():
    reconciler, workers, events = make({"a": (1, 1)})
    home, other = home_and_other("a")
    workers.held[home]["a"] = info("a")
    workers.held[other]["a"] = info("a")  # one copy too many, idle
    await reconciler.reconcile_once()
    assert "a" not in workers.held[other] and "a" in workers.held[home]
    withdrawn = events.index(("store", other, "a", None))
    assert withdrawn < events.index(("unload", other, "a")), events


async def test_residency_is_published_only_after_a_load_succeeded():
    reconciler, workers, events = make({"a": (1, 1), "bad": (1, 1)})
    workers.refuse.add("bad")
    await reconciler.reconcile_once()
    (home,) = [p for p in PODS if "a" in workers.held[p]]
    assert events.index(("load", home, "a")) < events.index(("store", home, "a", "cpu"))
    assert not [e for e in events if e[0] == "store" and e[2] == "bad"], events  # refused: never published
    assert reconciler.adapters["bad"].failure is not None


async def test_a_copy_in_use_beyond_the_placement_is_kept_until_idle():
    """A router's second copy under load (demand below one replica's worth) is not unloaded at every
    round, only once it has been idle for `idle_unload_s`, and only within the adapter's max."""
    reconciler, workers, events = make({"a": (1, 2), "b": (1, 1)})
    for name in ("a", "b"):
        home, other = home_and_other(name)
        workers.held[home][name] = info(name, last_used=NOW - 1)
        workers.held[other][name] = info(name, last_used=NOW - 1)  # the router's copy, serving
    for _ in range(3):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert [e[1:] for e in events if e[0] == "unload"] == [(home_and_other("b")[1], "b")]  # b's max is 1
    reconciler.clock = lambda: NOW - 1 + reconciler.settings.idle_unload_s  # idle long enough
    reconciler.wake(resync=True)
    await reconciler.reconcile_once()
    assert {p for p in PODS if "a" in workers.held[p]} == {home_and_other("a")[0]}


async def test_idleness_is_the_workers_own_as_of_its_poll():
    """The worker's `idle_s` decides, not the operator's clock against the worker's `last_used`
    (another machine's clock), and a round between polls does not count the inventory's age as
    idle time: a copy 30 s idle at the poll stays, whatever the clocks say, until a poll shows it
    idle for `idle_unload_s`."""
    reconciler, workers, events = make({"a": (1, 2)})
    home, other = home_and_other("a")
    skewed = NOW - 3600  # the worker's clock an hour behind the operator's
    workers.held[home]["a"] = info("a", last_used=skewed, idle_s=30.0)
    workers.held[other]["a"] = info("a", last_used=skewed, idle_s=30.0)  # the router's copy
    await reconciler.reconcile_once()
    reconciler.clock = lambda: NOW + 45  # a round woken by an event, on the same inventory
    reconciler.wake()
    await reconciler.reconcile_once()
    assert not [e for e in events if e[0] == "unload"], events
    workers.held[other]["a"] = info("a", last_used=skewed, idle_s=reconciler.settings.idle_unload_s)
    reconciler.wake(resync=True)  # a poll shows it idle long enough
    await reconciler.reconcile_once()
    assert [e[1:] for e in events if e[0] == "unload"] == [(other, "a")]


def respec(reconciler: PoolReconciler, name: str, status: dict | None = None, **spec: object) -> None:
    full = {"pool": "pool", "source": name, "replicas": {"min": 1, "max": 1}, **spec}
    reconciler.upsert_adapter(parse_adapter("ns", name, full), 2, status)


async def test_a_source_changed_while_no_operator_ran_is_reloaded():
    """After a restart only `status.source` tells that the copies come from an older source."""
    reconciler, workers, events = make({})
    home, _ = home_and_other("a")
    workers.held[home]["a"] = info("a", path="/adapters/a-v1")
    respec(reconciler, "a", status={"phase": "Ready", "source": "a-v1"}, source="a-v2")
    await reconciler.reconcile_once()
    assert workers.held[home]["a"].digest == digest_of("/adapters/a-v2")
    assert [e for e in events if e[0] in ("load", "reload", "unload")] == [("reload", home, "a")]
    assert reconciler.adapters["a"].status["source"] == "a-v2"
    events.clear()
    for _ in range(2):  # settled: the current copy is not reloaded again
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert not [e for e in events if e[0] in ("load", "reload", "unload")], events


async def test_an_old_version_in_use_is_swapped_once_its_requests_finish():
    reconciler, workers, events = make({"a": (1, 1)})
    await reconciler.reconcile_once()
    (home,) = [p for p in PODS if "a" in workers.held[p]]
    workers.held[home]["a"] = info("a", in_flight=3)
    respec(reconciler, "a", source="a-v2")
    result = await reconciler.reconcile_once()
    assert result.errors == 1  # retried soon, not failed
    status = reconciler.adapters["a"].status
    assert (status["phase"], status["readyReplicas"], status["source"]) == ("Loading", 0, "a"), status
    workers.held[home]["a"] = info("a", in_flight=0)
    await reconciler.reconcile_once()
    assert workers.held[home]["a"].digest == digest_of("/adapters/a-v2")
    status = reconciler.adapters["a"].status
    assert (status["phase"], status["readyReplicas"], status["source"]) == ("Ready", 1, "a-v2"), status
    assert not [e for e in events if e[0] == "unload"], events


async def one_busy_copy() -> tuple[PoolReconciler, StubWorkers, list[tuple], list[float], str, str]:
    """Adapter `a` (one replica) loaded on its home pod, which now always has requests in flight;
    the reconciler's clock is `now[0]`."""
    reconciler, workers, events = make({"a": (1, 1)})
    now = [NOW]
    reconciler.clock = lambda: now[0]
    await reconciler.reconcile_once()
    home, other = home_and_other("a")
    workers.held[home]["a"] = info("a", in_flight=3)
    return reconciler, workers, events, now, home, other


async def test_an_old_version_never_idle_is_drained_after_the_grace():
    """Under steady traffic the in-place swap never finds a moment without requests. After
    `reload_grace_s` the new version is loaded on another worker first (make before break: it is
    judged there while the old copy still serves), then the old copy is withdrawn and unloaded
    (its requests finish with it on the worker), instead of retrying for ever."""
    reconciler, workers, events, now, home, other = await one_busy_copy()
    respec(reconciler, "a", source="a-v2")
    events.clear()
    for step in (0.0, 15.0, 14.9):  # within the grace: retried in place, never unloaded
        now[0] += step
        assert (await reconciler.reconcile_once()).errors >= 1
    assert [e[0] for e in events if e[0] in ("load", "reload", "unload")] == ["reload"] * 3
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")
    now[0] += 0.1  # 30 s since the first refusal
    events.clear()
    await reconciler.reconcile_once()
    calls = [e for e in events if e[0] in ("load", "reload", "unload")]
    assert calls[:2] == [("reload", home, "a"), ("load", other, "a")], calls  # the new version elsewhere first
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")  # the old one still serves
    events.clear()
    reconciler.wake(resync=True)
    await reconciler.reconcile_once()
    calls = [e for e in events if e[0] in ("load", "reload", "unload", "store")]
    assert ("store", home, "a", None) in calls and ("unload", home, "a") in calls, calls  # now drained
    assert calls.index(("store", home, "a", None)) < calls.index(("unload", home, "a"))
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    loaded = [p for p in PODS if "a" in workers.held[p]]
    assert loaded and all(workers.held[p]["a"].digest == digest_of("/adapters/a-v2") for p in loaded)
    status = reconciler.adapters["a"].status
    assert (status["phase"], status["source"]) == ("Ready", "a-v2"), status


async def test_a_busy_copy_is_not_drained_for_a_version_judged_wrong_on_the_spare():
    """The only copy is busy and the new source's content does not have the spec's sha256 (a
    refused folder is refused before the worker looks at requests in flight; this is the case that
    gets past the grace): judged on the spare worker, the update is refused there and the busy copy
    is never drained (was: drained, then the new content failed DigestMismatch, served nowhere)."""
    reconciler, workers, events, now, home, other = await one_busy_copy()
    respec(reconciler, "a", source="a-v2", sha256="f" * 64)
    for step in (0.0, 31.0, 10.0, 10.0):
        now[0] += step
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.failure is None and record.update_refused is not None
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")
    assert ("unload", home, "a") not in events, events
    assert all(held["a"].digest == digest_of("/adapters/a") for held in workers.held.values() if "a" in held)


async def test_a_refused_update_leaves_the_old_version_serving_and_scaling():
    """The new source is refused: the old copy stays (not Failed, not unloaded), the status says
    so, nothing is retried for this spec, a new copy (more replicas) and the router's catalog
    use the old version's path; a new spec rolls out again."""
    reconciler, workers, events = make({"a": (1, 1)})
    await reconciler.reconcile_once()
    (home,) = [p for p in PODS if "a" in workers.held[p]]
    workers.refuse.add("/adapters/a-bad")
    respec(reconciler, "a", source="a-bad")
    await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.problem is None and record.update_refused == ("LoadRefused", "not an adapter")
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")
    status = record.status
    conds = {c["type"]: c for c in status["conditions"]}
    assert (status["phase"], status["readyReplicas"], status["source"]) == ("Ready", 1, "a"), status
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("True", "UpdateRefused")
    assert (conds["Updated"]["status"], conds["Updated"]["reason"]) == ("False", "LoadRefused")
    assert await reconciler.store.catalog() == {"a": "/adapters/a"}
    events.clear()
    respec(reconciler, "a", source="a-bad", replicas={"min": 2, "max": 2})  # more replicas, same refused source
    assert reconciler.adapters["a"].update_refused is not None  # carried over: the content asked for is the same
    for _ in range(2):
        await reconciler.reconcile_once()
    assert [e for e in events if e[0] in ("load", "reload", "unload")] == [("load", next(p for p in PODS if p != home), "a")]
    assert all(workers.held[p]["a"].digest == digest_of("/adapters/a") for p in PODS)
    assert reconciler.adapters["a"].status["readyReplicas"] == 2
    respec(reconciler, "a", source="a-v2", replicas={"min": 2, "max": 2})
    for _ in range(2):
        await reconciler.reconcile_once()
    assert all(workers.held[p]["a"].digest == digest_of("/adapters/a-v2") for p in PODS)
    status = reconciler.adapters["a"].status
    assert status["source"] == "a-v2" and "Updated" not in {c["type"] for c in status["conditions"]}


async def test_a_digest_mismatch_fails_only_a_first_version():
    """A copy someone else loaded (a router, an older spec) with another digest is reloaded; the
    adapter fails DigestMismatch only when the spec's own source, loaded first, gives another digest."""
    reconciler, workers, events = make({})
    home, _ = home_and_other("a")
    workers.held[home]["a"] = info("a", path="/adapters/elsewhere")
    respec(reconciler, "a", sha256=digest_of("/adapters/a").removeprefix("sha256:"))
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].failure is None
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")
    # A sha256 its source cannot give (bumped before the files were copied, or a typo): the reload
    # is a no-op, so the version it has keeps serving, reported, rather than a DigestMismatch outage.
    respec(reconciler, "a", sha256="f" * 64)
    await reconciler.reconcile_once()
    reconciler.wake(resync=True)
    await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.failure is None and record.update_refused is not None and record.update_refused[0] == "DigestMismatch"
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")
    conds = {c["type"]: c for c in record.status["conditions"]}
    assert conds["Ready"]["reason"] == "UpdateRefused" and conds["Updated"]["reason"] == "DigestMismatch"
    # A first load whose content does not match: Failed, and served nowhere.
    respec(reconciler, "b", sha256="f" * 64)
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert reconciler.adapters["b"].failure is not None and reconciler.adapters["b"].failure[0] == "DigestMismatch"
    assert not any("b" in held for held in workers.held.values())


async def test_a_copy_of_the_old_version_found_after_the_rollout_is_reloaded():
    """A router cold-loaded the old version from the catalog before the rollout published the new
    path (or a pod missed the rollout): once the new content's digest is known, any copy with
    another digest is old, whatever the rollout's bookkeeping says."""
    reconciler, workers, events = make({"a": (2, 2)})
    await reconciler.reconcile_once()
    respec(reconciler, "a", source="a-v2", replicas={"min": 2, "max": 2})
    await reconciler.reconcile_once()
    assert all(workers.held[p]["a"].digest == digest_of("/adapters/a-v2") for p in PODS)
    # p1 restarts (a new worker) and a router, on the catalog it read before, loads the old version there.
    reconciler.remove_pod("p1")
    reconciler.observe_pod(PodState("p1", "10.0.0.1", ready=True, draining=False))
    workers.held["p1"] = {"a": info("a", path="/adapters/a")}
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert workers.held["p1"]["a"].digest == digest_of("/adapters/a-v2")
    assert reconciler.adapters["a"].failure is None and reconciler.adapters["a"].status["readyReplicas"] == 2


async def test_an_old_disk_tier_entry_is_replaced_not_a_content_conflict():
    """A pod that still lists an old version (evicted to the disk tier, so not resident) gets the
    new one in place when the placement loads there; a plain load was a 409 that failed the adapter."""
    reconciler, workers, events = make({"a": (2, 2)})
    home, other = home_and_other("a")
    workers.held[other]["a"] = info("a", path="/adapters/a-old", tier="disk")
    for _ in range(3):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.problem is None, record.problem
    assert all(workers.held[p]["a"].digest == digest_of("/adapters/a") for p in PODS)
    assert record.status["phase"] == "Ready" and record.status["readyReplicas"] == 2


async def test_a_new_copy_refused_while_the_old_version_serves_is_an_update_refusal():
    """Source and replicas changed in one edit: the in-place reload of the old copy fails for a
    while (a busy worker), the placement's new copy is refused: the old version keeps serving."""
    reconciler, workers, events = make({"a": (1, 1)})
    await reconciler.reconcile_once()
    home, other = home_and_other("a")
    workers.held[home]["a"] = info("a", in_flight=2)
    workers.refuse.add("/adapters/a-bad")
    respec(reconciler, "a", source="a-bad", replicas={"min": 2, "max": 2})
    for _ in range(2):
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.failure is None and record.update_refused is not None, (record.failure, record.update_refused)
    assert workers.held[home]["a"].digest == digest_of("/adapters/a")  # never unloaded
    assert record.serving_path == "/adapters/a"


async def test_pool_dependent_failures_are_judged_again_when_the_pool_changes():
    reconciler, workers, events = make({})
    reconciler.upsert_adapter(parse_adapter("ns", "a", {"pool": "pool", "source": "a", "rank": 32}), 1, None)
    small = PoolSpec("ns", "pool", "img", "/model", "base", engine=EngineSpec(max_lora_rank=16))
    reconciler.set_pool(small, "token")
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].failure[0] == "RankTooHigh"
    reconciler.set_pool(PoolSpec("ns", "pool", "img", "/model", "base"), "token")  # maxLoraRank back to 64
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].failure is None
    assert any("a" in held for held in workers.held.values())


async def test_a_min_zero_adapter_of_a_deleted_pool_is_not_ready():
    reconciler, workers, events = make({"a": (0, 1)})
    await reconciler.reconcile_once()
    reconciler.set_pool(None, None)
    await reconciler.reconcile_once()
    status = reconciler.adapters["a"].status
    assert status["phase"] == "Pending" and status["conditions"][-1]["reason"] == "PoolNotFound", status


def test_a_removed_pod_forgets_its_busy_reload() -> None:
    reconciler, workers, events = make({"a": (1, 1)})
    reconciler.adapters["a"].busy_since["p0"] = NOW - 3600
    reconciler.remove_pod("p0")
    assert reconciler.adapters["a"].busy_since == {}


async def test_a_sha256_no_copy_matches_keeps_the_served_version_with_an_older_one_around():
    """Pod p1 holds an older version (after an operator restart nothing marks it ours), p0 the
    source's content; the spec's sha256 is bumped before the files are copied. The reloads give
    p0's content again, p1's becomes it too: the served version stays, UpdateRefused with
    DigestMismatch, and neither copy is unloaded (was: p1's reload verified it and the adapter
    failed DigestMismatch, unloaded everywhere)."""
    reconciler, workers, events = make({"a": (2, 2)})
    await reconciler.reconcile_once()
    served = digest_of("/adapters/a")
    reconciler.remove_pod("p1")
    reconciler.observe_pod(PodState("p1", "10.0.0.1", ready=True, draining=False))
    workers.held["p1"] = {"a": info("a", path="/adapters/a-older", tier="disk")}
    respec(reconciler, "a", sha256="f" * 64, replicas={"min": 2, "max": 2})
    for _ in range(3):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.failure is None and record.update_refused is not None, (record.failure, record.update_refused)
    assert record.update_refused[0] == "DigestMismatch" and record.serving_digest == served
    assert all(workers.held[p]["a"].digest == served for p in PODS)
    assert not [e for e in events if e[0] == "unload"], events
    status = record.status
    assert (status["phase"], status["readyReplicas"], status["digest"]) == ("Ready", 2, served), status


async def test_a_busy_copy_on_a_pool_of_one_is_judged_under_a_scratch_name_before_a_drain():
    """No other worker to load the new version on: it is tried under a scratch name beside the busy
    copy; content without the spec's sha256 refuses the update, and the copy is never drained."""
    reconciler, workers, events, now, home, other = await one_busy_copy()
    reconciler.remove_pod(other)
    respec(reconciler, "a", source="a-v2", sha256="f" * 64)
    for step in (0.0, 31.0, 10.0):
        now[0] += step
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.failure is None and record.update_refused is not None and record.update_refused[0] == "DigestMismatch"
    assert ("load", home, "a__lorafleet_probe") in events and ("unload", home, "a__lorafleet_probe") in events
    assert ("unload", home, "a") not in events and workers.held[home]["a"].digest == digest_of("/adapters/a")


async def test_an_edit_before_the_last_one_was_judged_keeps_the_serving_version_to_fall_back_on():
    """B's canary never ran (busy) before the user edited again to C: C's fallback is what
    served before B (X), not B's content, which no copy ever held."""
    reconciler, workers, events, now, home, other = await one_busy_copy()
    served = digest_of("/adapters/a")
    respec(reconciler, "a", source="a-v2", sha256="b" * 64)
    await reconciler.reconcile_once()
    respec(reconciler, "a", source="a-v3", sha256="c" * 64)
    assert reconciler.adapters["a"].previous_digest == served


def test_the_version_kept_serving_is_the_previous_specs() -> None:
    record = AdapterRecord(parse_adapter("ns", "a", {"pool": "pool", "source": "v3"}), 1, None)
    record.previous_digest = "sha256:" + "b" * 64
    v1 = info("a", path="/adapters/v1", tier="disk").model_copy(update={"digest": "sha256:" + "a" * 64})
    v2_disk = info("a", path="/adapters/v2-disk", tier="disk").model_copy(update={"digest": "sha256:" + "b" * 64})
    v2 = info("a", path="/adapters/v2").model_copy(update={"digest": "SHA256:" + "B" * 64})  # any case
    assert pool_state.serving_version(record, [v1, v2_disk, v2]) is v2  # the previous content, resident first
    assert pool_state.serving_version(record, [v1]) is None  # leftovers of other content are no fallback
    record.previous_digest = None  # a first version: nothing to fall back on
    assert pool_state.serving_version(record, [v1, v2]) is None


async def test_a_refused_update_is_probed_again_and_rolls_out_once_the_files_are_fixed():
    reconciler, workers, events = make({"a": (2, 2)})
    now = [NOW]
    reconciler.clock = lambda: now[0]
    await reconciler.reconcile_once()
    workers.refuse.add("/adapters/a-v2")  # not there yet
    respec(reconciler, "a", source="a-v2", replicas={"min": 2, "max": 2})
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].update_refused is not None
    events.clear()
    now[0] += 10.0  # before the first probe (30 s): nothing tried
    reconciler.wake(resync=True)
    await reconciler.reconcile_once()
    assert not [e for e in events if e[0] in ("load", "reload")], events
    workers.refuse.discard("/adapters/a-v2")  # the files arrive
    now[0] += 25.0
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.update_refused is None and all(workers.held[p]["a"].digest == digest_of("/adapters/a-v2") for p in PODS)
    assert record.status["source"] == "a-v2" and "Updated" not in {c["type"] for c in record.status["conditions"]}


async def test_an_old_version_where_a_verified_copy_was_is_reloaded():
    """A verified copy is forgotten once a poll shows other content there (scaled down, then a
    router loaded the old version from an older catalog): it is reloaded, not trusted for ever."""
    reconciler, workers, events = make({"a": (1, 1)})
    await reconciler.reconcile_once()
    (home,) = [p for p in PODS if "a" in workers.held[p]]
    respec(reconciler, "a", source="a-v2")
    await reconciler.reconcile_once()
    workers.held[home]["a"] = info("a", path="/adapters/a")  # the old version again, behind our back
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert workers.held[home]["a"].digest == digest_of("/adapters/a-v2")


async def test_a_refused_update_with_no_version_left_is_served_from_the_old_path_or_fails():
    """Every copy gone (workers replaced): the old version is loaded back from its path; once that
    is refused too (its files gone), the refusal is dropped and the spec tried as a first load."""
    reconciler, workers, events = make({"a": (1, 1)})
    await reconciler.reconcile_once()
    workers.refuse.add("/adapters/a-bad")
    respec(reconciler, "a", source="a-bad")
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].update_refused is not None
    for held in workers.held.values():
        held.clear()
    for _ in range(2):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert [p for p in PODS if workers.held[p].get("a") and workers.held[p]["a"].digest == digest_of("/adapters/a")]
    assert reconciler.adapters["a"].status["phase"] == "Ready"
    for held in workers.held.values():
        held.clear()
    workers.refuse.add("/adapters/a")  # the old version's files are gone too
    for _ in range(3):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    record = reconciler.adapters["a"]
    assert record.update_refused is None and record.failure is not None and record.failure[0] == "LoadRefused"


def test_digests_compare_without_case_or_prefix() -> None:
    assert pool_state.same_digest("sha256:ABCD", "abcd") and digest_matches("ABCD", "sha256:abcd")


async def test_a_round_that_raises_does_not_end_the_pools_loop():
    """An unforeseen exception (a bug, an answer nobody expected) is logged and retried with
    backoff; the loop, which is the pool's kopf daemon, must not die with it."""
    reconciler, workers, events = make({"a": (1, 1)})
    reconciler.settings = ReconcilerSettings(retry_s=0.001)
    reconciler._crashes = 5000  # a bug that raised for hours: the backoff must not overflow (2.0 ** 5001)
    workers.broken = 4
    stopped = asyncio.Event()
    loop = asyncio.create_task(reconciler.run(stopped))
    try:
        for _ in range(100):
            if any("a" in held for held in workers.held.values()):
                break
            await asyncio.sleep(0.05)
        assert not loop.done(), loop
        assert any("a" in held for held in workers.held.values()), events
    finally:
        stopped.set()
        reconciler.wake()
        await asyncio.wait_for(loop, 2)

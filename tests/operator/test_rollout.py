"""A changed adapter (source or sha256) rolling out, against stub workers (no HTTP, no kopf): old
versions replaced in place, one canary first, busy copies drained only once the new version serves
elsewhere, refused updates leaving the previous version serving and probed again."""

from __future__ import annotations

from lorafleet.operator import pool_state
from lorafleet.operator.pool_state import AdapterRecord, PodState
from lorafleet.operator.spec import digest_matches, parse_adapter
from tests.operator.reconciler_stubs import (
    NOW,
    PODS,
    digest_of,
    home_and_other,
    info,
    make,
    one_busy_copy,
    respec,
)


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
    assert ("store", "ns/" + home, "a", None) in calls and ("unload", home, "a") in calls, calls  # now drained
    assert calls.index(("store", "ns/" + home, "a", None)) < calls.index(("unload", home, "a"))
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

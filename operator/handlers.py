"""kopf handlers: thin. Parse, call a pure builder or the reconciler, map errors to kopf's kinds.

Handlers are registered by `register(registry, config)` rather than module-level decorators, so the
CLI and the tests build a fresh registry with their own settings and nothing lives in globals.
Everything long-lived (clients, the fleet of reconcilers) is created in the startup hook and kept
in kopf's memo.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import kopf

from lorafleet.operator import builders, retire
from lorafleet.operator.fleet import Fleet
from lorafleet.operator.kube import Conflict, KubeClient, KubeError, NotFound
from lorafleet.operator.pod_roll import hold_scale_down
from lorafleet.operator.pool_state import PodState, ReconcilerSettings
from lorafleet.operator.spec import GROUP, POOL_LABEL, VERSION, SpecError, parse_adapter, parse_pool
from lorafleet.operator.status import AdapterObservation, Condition, adapter_status, render_conditions
from lorafleet.operator.worker_client import WorkerClient

ADAPTERS = (GROUP, VERSION, "loraadapters")
POOLS = (GROUP, VERSION, "lorapools")


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    redis_url: str | None = None
    reconciler: ReconcilerSettings = field(default_factory=ReconcilerSettings)
    worker_timeout_s: float = 10.0
    peering: str | None = None  # None = standalone
    kube_info: Any | None = None  # a kopf.ConnectionInfo; None = service account, then kubeconfig


def _kube_info(config: OperatorConfig, settings: kopf.OperatorSettings, logger: logging.Logger) -> Any:
    if config.kube_info is not None:
        return config.kube_info
    info = kopf.login_with_service_account(settings=settings, logger=logger)
    return info or kopf.login_with_kubeconfig(settings=settings, logger=logger)


async def _make_store(url: str | None, logger: logging.Logger) -> Any | None:
    if not url:
        return None
    from lorafleet.placement_store import RedisPlacementStore

    store = RedisPlacementStore.from_url(url)
    try:
        await store.ping()
    except Exception as exc:  # run without publishing rather than not at all; say so loudly
        logger.warning(f"placement store {url} unreachable ({exc}); placements are not published until it answers")
    return store


def failed_status(reason: str, message: str, generation: int | None, previous: dict | None) -> dict[str, Any]:
    obs = AdapterObservation(generation, desired=0, placed=0, ready=0, loading=False, failure=(reason, message))
    return adapter_status(obs, previous)


async def _apply_child(kube: KubeClient, manifest: dict[str, Any]) -> None:
    """Create if absent; otherwise bring spec, labels and owner back to the built manifest."""
    api, kind = manifest["apiVersion"], manifest["kind"]
    plural = {"Deployment": "deployments", "StatefulSet": "statefulsets", "Service": "services",
              "PodDisruptionBudget": "poddisruptionbudgets", "Secret": "secrets"}[kind]
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        await kube.create(KubeClient.path(api, plural, ns), manifest)
        return
    except Conflict:
        pass
    if kind == "Secret":
        return  # the token is generated once and kept
    current = await kube.get(KubeClient.path(api, plural, ns, name))
    wanted_meta = {k: manifest["metadata"][k] for k in ("labels", "ownerReferences") if k in manifest["metadata"]}
    drifted = {k: v for k, v in manifest["spec"].items() if current.get("spec", {}).get(k) != v}
    meta_drift = {k: v for k, v in wanted_meta.items() if current.get("metadata", {}).get(k) != v}
    if drifted or meta_drift:
        await kube.patch(KubeClient.path(api, plural, ns, name), {"metadata": meta_drift, "spec": drifted})


async def _ensure_token(kube: KubeClient, pool: Any, owner: kopf.Body) -> str:
    path = KubeClient.path("v1", "secrets", pool.namespace, pool.token_secret)
    try:
        return builders.read_token(await kube.get(path))
    except NotFound:
        pass
    secret = builders.token_secret(pool, secrets.token_urlsafe(32))
    kopf.adopt(secret, owner=owner)
    try:
        await kube.create(KubeClient.path("v1", "secrets", pool.namespace), secret)
    except Conflict:  # created by a concurrent run: theirs wins
        return builders.read_token(await kube.get(path))
    return builders.read_token(secret)


def _pod_state(body: kopf.Body | dict[str, Any]) -> PodState:
    meta = body["metadata"]
    conditions = {c.get("type"): c.get("status") == "True" for c in body.get("status", {}).get("conditions") or []}
    gates = {g.get("conditionType") for g in (body.get("spec") or {}).get("readinessGates") or []}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    try:
        cost = int(annotations[retire.COST]) if retire.COST in annotations else None
    except ValueError:
        cost = None
    return PodState(
        name=meta["name"],
        ip=body.get("status", {}).get("podIP"),
        # The worker is up once its containers are; Ready waits for the readiness gate too.
        ready=conditions.get("ContainersReady", conditions.get("Ready", False)),
        draining=bool(meta.get("deletionTimestamp")),
        serving=conditions.get("Ready", False),
        gated=retire.GATE in gates,
        gate_open=conditions.get(retire.GATE, False),
        revision=labels.get("pod-template-hash") or labels.get("controller-revision-hash") or "",
        cost=cost,
        created=meta.get("creationTimestamp") or "",
        uid=meta.get("uid") or "",
    )


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    rs = config.reconciler

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # k8s Events only for problems: they are API writes too
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-applied")
        settings.watching.server_timeout = 300
        # No cluster-wide scans: the watched namespaces are exact names (or all of them with -A) and
        # the CRDs exist before the operator starts. Scanning lists namespaces and watches CRDs
        # cluster-wide, which a namespaced ServiceAccount may not: kopf then retries each 403 with
        # back-off (about 55 s) before the first namespaced watch starts.
        settings.scanning.disabled = True
        settings.networking.request_timeout = 60
        if config.peering:
            settings.peering.name = config.peering
            settings.peering.mandatory = True
        info = _kube_info(config, settings, logger)
        memo.kube_info = info
        kube = KubeClient.from_connection_info(info)
        memo.fleet = Fleet(WorkerClient.create(config.worker_timeout_s), kube, await _make_store(config.redis_url, logger), rs)

    @kopf.on.login(registry=registry)
    def login(memo: kopf.Memo, settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> Any:
        return getattr(memo, "kube_info", None) or _kube_info(config, settings, logger)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        fleet: Fleet | None = getattr(memo, "fleet", None)
        if fleet is not None:
            await fleet.workers.close()
            if fleet.kube is not None:
                await fleet.kube.close()
            if fleet.store is not None:
                await fleet.store.close()

    # ---- LoraPool ------------------------------------------------------------------------------

    @kopf.on.resume(*POOLS, registry=registry)
    @kopf.on.create(*POOLS, registry=registry)
    @kopf.on.update(*POOLS, field="spec", registry=registry)
    async def pool_apply(
        spec: kopf.Spec, name: str, namespace: str, body: kopf.Body, meta: kopf.Meta,
        memo: kopf.Memo, patch: kopf.Patch, retry: int, **_: Any,
    ) -> None:
        fleet: Fleet = memo.fleet
        previous = body.get("status", {}).get("conditions")
        generation = meta.get("generation")

        def reconciled(ok: bool, reason: str, message: str) -> list[dict[str, Any]]:
            return render_conditions([Condition("Reconciled", ok, reason, message)], previous, generation)

        try:
            pool = parse_pool(namespace, name, spec)
        except SpecError as exc:
            fleet.pool(namespace, name).set_pool(None, None, problem=("PoolInvalid", f"LoraPool {name}: {exc}"))
            patch.status["phase"] = "Failed"
            patch.status["conditions"] = reconciled(False, exc.reason, str(exc))
            return
        assert fleet.kube is not None
        try:
            token = await _ensure_token(fleet.kube, pool, body)
            for child in builders.pool_children(pool, token)[1:]:
                kopf.adopt(child, owner=body)
                await _apply_child(fleet.kube, await hold_scale_down(fleet.kube, child))
        except (KubeError, OSError) as exc:
            # Shown on the pool (kopf applies the patch whatever the handler raises).
            patch.status["conditions"] = reconciled(False, "ChildrenNotApplied", f"workers' objects not applied: {exc}")
            status = exc.status if isinstance(exc, KubeError) else 0
            if status in (400, 422):  # the API server refuses what this spec builds: wait for a new spec
                serving = fleet.pool(namespace, name).pool is not None or body.get("status", {}).get("readyReplicas", 0)
                if not serving:  # no workers from an earlier spec either (also across an operator restart)
                    patch.status["phase"] = "Failed"
                # else the earlier spec's workers still serve: the phase stays theirs (the pool's
                # loop writes it), the Reconciled condition says the new spec was refused
                raise kopf.PermanentError(f"children of {name} refused: {exc}") from exc
            # Transient (network, 5xx), or maybe not (403: RBAC, quota): retry with backoff, each
            # retry being a warning Event too; a new spec is picked up at the next retry.
            raise kopf.TemporaryError(f"children of {name}: {exc}", delay=min(5 * 2 ** retry, 60)) from exc
        fleet.pool(namespace, name).set_pool(pool, token)
        patch.status["observedGeneration"] = generation
        patch.status["conditions"] = reconciled(True, "Reconciled", f"{pool.workload_kind}, Service, "
                                                f"PodDisruptionBudget and Secret {pool.token_secret} are up to date")

    @kopf.on.delete(*POOLS, optional=True, registry=registry)
    async def pool_delete(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        # Children go with their owner (garbage collection); adapters stay, Pending, until a pool returns.
        # The pool's daemon is stopped by now: its reconciler writes their statuses here, once.
        await memo.fleet.pool(namespace, name).pool_deleted()

    @kopf.daemon(*POOLS, cancellation_timeout=1.0, registry=registry)
    async def pool_loop(
        name: str, namespace: str, spec: kopf.Spec, memo: kopf.Memo, logger: logging.Logger, **_: Any,
    ) -> None:
        # Each start of this daemon begins a term: the operator's first, or a takeover after kopf
        # peering paused it (a pause stops daemons; the resumed watch starts them again). A term
        # starts from the API server's objects: what this process remembers of an earlier term
        # (adapters deleted or rescaled by another leader meanwhile) is dropped first.
        fleet: Fleet = memo.fleet
        fleet.drop_pool(namespace, name)
        reconciler = fleet.pool(namespace, name)
        await _set_pool_from_spec(fleet, namespace, name, spec, logger)
        await _adopt_existing_adapters(fleet, namespace, name, logger)
        await _adopt_existing_pods(fleet, namespace, name, logger)
        reconciler.wake(resync=True)
        await reconciler.run()

    @kopf.timer(*POOLS, interval=rs.resync_s, idle=None, registry=registry)
    async def pool_resync(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        # Level-triggered: re-read every worker's real inventory and repair drift.
        memo.fleet.pool(namespace, name).wake(resync=True)

    # ---- LoraAdapter ---------------------------------------------------------------------------

    @kopf.on.resume(*ADAPTERS, registry=registry)
    @kopf.on.create(*ADAPTERS, registry=registry)
    @kopf.on.update(*ADAPTERS, field="spec", registry=registry)
    async def adapter_apply(
        spec: kopf.Spec, name: str, namespace: str, meta: kopf.Meta, status: kopf.Status,
        memo: kopf.Memo, patch: kopf.Patch, **_: Any,
    ) -> None:
        fleet: Fleet = memo.fleet
        try:
            adapter = parse_adapter(namespace, name, spec)
        except SpecError as exc:
            # Permanent: mark Failed once; the next attempt comes with the next spec change.
            reconciler = fleet.forget_adapter(namespace, name)
            if reconciler is not None:
                await reconciler.unload_everywhere(name, keep_catalog=fleet.name_shared(namespace, name))
            patch.status.update(failed_status(exc.reason, str(exc), meta.get("generation"), dict(status)))
            return
        fleet.upsert_adapter(adapter, meta.get("generation"), dict(status) if status else None,
                             meta.get("creationTimestamp"))

    @kopf.on.delete(*ADAPTERS, registry=registry)
    async def adapter_delete(spec: kopf.Spec, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        fleet: Fleet = memo.fleet
        fleet.forget_adapter(namespace, name)
        shared = fleet.name_shared(namespace, name)  # another namespace's adapter of that name: its entry
        pool = spec.get("pool")
        if not pool or (namespace, pool) not in fleet.pools:
            if not shared:
                await fleet.remove_from_catalog(name)
            return  # never placed anywhere this operator knows
        pending = await fleet.pool(namespace, pool).unload_everywhere(name, keep_catalog=shared)
        if pending:
            raise kopf.TemporaryError(f"unload of {name} not verified on {', '.join(pending)}", delay=2)

    # ---- worker pods ---------------------------------------------------------------------------

    @kopf.on.event("", "v1", "pods", labels={POOL_LABEL: kopf.PRESENT}, registry=registry)
    async def pod_event(event: dict[str, Any], body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any) -> None:
        fleet: Fleet | None = getattr(memo, "fleet", None)
        if fleet is None:
            return
        pool = body["metadata"].get("labels", {}).get(POOL_LABEL)
        reconciler = fleet.pool(namespace, pool)
        if event.get("type") == "DELETED":
            reconciler.remove_pod(body["metadata"]["name"])
        else:
            reconciler.observe_pod(_pod_state(body))


async def _list(fleet: Fleet, path: str, what: str, logger: logging.Logger) -> list[dict[str, Any]] | None:
    """A collection's items, a few tries; None if the API server does not answer."""
    assert fleet.kube is not None
    for attempt in range(5):
        try:
            return (await fleet.kube.get(path)).get("items", [])
        except (KubeError, OSError) as exc:
            logger.warning(f"listing {what} failed ({exc}); retrying")
            await asyncio.sleep(1 + attempt)
    return None


async def _set_pool_from_spec(fleet: Fleet, namespace: str, name: str, spec: Any, logger: logging.Logger) -> None:
    """The pool as its object says now (its children are pool_apply's to write)."""
    try:
        pool = parse_pool(namespace, name, spec)
    except SpecError as exc:
        fleet.pool(namespace, name).set_pool(None, None, problem=("PoolInvalid", f"LoraPool {name}: {exc}"))
        return
    if fleet.kube is None:
        return
    try:
        token = builders.read_token(await fleet.kube.get(KubeClient.path("v1", "secrets", namespace, pool.token_secret)))
    except (KubeError, OSError, KeyError, ValueError) as exc:  # not created yet: pool_apply sets the pool then
        logger.info(f"pool {name}: admin token not readable yet ({exc})")
        return
    fleet.pool(namespace, name).set_pool(pool, token)


async def _adopt_existing_pods(fleet: Fleet, namespace: str, pool: str, logger: logging.Logger) -> None:
    """Observe the pool's existing worker pods before the first round.

    After an operator restart the pod watch may not have delivered them yet; a round without them
    would count no replicas and write Ready adapters as Pending until the next round.
    """
    if fleet.kube is None:
        return
    items = await _list(fleet, KubeClient.path("v1", "pods", namespace), "pods", logger)
    reconciler = fleet.pool(namespace, pool)
    for item in items or []:
        if (item.get("metadata", {}).get("labels") or {}).get(POOL_LABEL) == pool:
            reconciler.observe_pod(_pod_state(item))


async def _adopt_existing_adapters(fleet: Fleet, namespace: str, pool: str, logger: logging.Logger) -> None:
    """Register every existing adapter of the pool before the first round.

    Otherwise, after an operator restart, the first round could run before kopf has resumed all
    adapters and would unload the ones it has not seen yet.
    """
    if fleet.kube is None:
        return
    items = await _list(fleet, KubeClient.path(f"{GROUP}/{VERSION}", "loraadapters", namespace), "adapters", logger)
    for item in items or []:
        meta = item.get("metadata", {})
        if meta.get("deletionTimestamp") or (item.get("spec") or {}).get("pool") != pool:
            continue
        try:
            adapter = parse_adapter(namespace, meta["name"], item.get("spec") or {})
        except SpecError:  # adapter_apply marks it Failed; the others must not wait for it
            continue
        if (namespace, adapter.name) not in fleet.adapter_pool:
            fleet.upsert_adapter(adapter, meta.get("generation"), item.get("status"), meta.get("creationTimestamp"))

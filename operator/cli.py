"""`lorafleet operator`: run the kopf operator (namespace-scoped by default).

High availability, `--peering NAME`: run several replicas, kopf peering keeps exactly one active.
Every replica writes a keep-alive (its priority, a 60 s lifetime) into the status of the peering
object NAME: a `KopfPeering` in the watched namespace, or a `ClusterKopfPeering` with `-A`. A
replica that sees a live peer of higher priority pauses all its watches; it resumes when that
keep-alive is removed (the peer exited) or expires (the peer was killed: up to 60 s without an
operator). Equal priorities freeze every replica, so each derives its own from the pod name unless
`--priority` is given. With `--peering` the peering is mandatory: without kopf's CRDs the operator
stays paused rather than run unguarded.

Setup: `kubectl apply -f crds/peering/` (kopf's two CRDs), then create the object once, e.g.
`{apiVersion: kopf.dev/v1, kind: KopfPeering, metadata: {name: NAME, namespace: NS}}` (without
it the replicas cannot see each other and all of them act); the operator's role needs list/watch/patch on it. A takeover needs no hand-over: each term
starts from the API server (the pools, adapters and pods are read again, nothing from an earlier
term is kept) and the new leader re-reads every worker's inventory before it acts; deleted
adapters stay held by their finalizer until it has unloaded them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
from typing import Any

from lorafleet.cli_help import finish
from lorafleet.operator.pool_state import ReconcilerSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet operator", description="Reconcile LoraPools and LoraAdapters.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=None,
        help="namespace to watch (repeatable; default: $POD_NAMESPACE or 'default')",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (needs a ClusterRole)")
    p.add_argument("--redis-url", default=os.environ.get("LORAFLEET_REDIS_URL"),
                   help="placement store shared with the router (default: $LORAFLEET_REDIS_URL; none = do not publish)")
    p.add_argument("--resync", type=float, default=10.0, help="seconds between inventory re-reads (drift repair)")
    p.add_argument("--worker-timeout", type=float, default=10.0, help="seconds per worker admin call")
    p.add_argument("--peering", default=None,
                   help="kopf peering name for HA (several operators, one active); default: standalone")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; must differ between replicas (default: derived from the pod name)")
    p.add_argument("--liveness", default=None, metavar="URL",
                   help="serve kopf's health endpoint for a livenessProbe, e.g. http://0.0.0.0:8080/healthz "
                        "(default: none)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return finish(p, {
        "Scope": ["--namespace", "--all-namespaces"],
        "Placement store": ["--redis-url"],
        "Reconciling": ["--resync", "--worker-timeout"],
        "High availability": ["--peering", "--priority", "--liveness"],
        "Logging": ["--verbose"],
    }, ("LORAFLEET_REDIS_URL", "POD_NAMESPACE", "HOSTNAME"))


def operator_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`kopf.operator`'s arguments for the parsed flags (registry aside)."""
    namespaces = () if args.all_namespaces else (args.namespace or [os.environ.get("POD_NAMESPACE", "default")])
    # Equal priorities freeze every peer; derive distinct ones from the (unique) pod name.
    priority = args.priority
    if priority is None:
        pod = os.environ.get("HOSTNAME") or os.urandom(8).hex()
        priority = int(hashlib.sha256(pod.encode()).hexdigest()[:6], 16) if args.peering else 0
    return {
        "clusterwide": args.all_namespaces,
        "namespaces": namespaces,
        "standalone": args.peering is None,
        "peering_name": args.peering,
        "priority": priority,
        "liveness_endpoint": args.liveness,
    }


def main(argv: list[str]) -> int:
    import kopf

    from lorafleet.operator.handlers import OperatorConfig, register

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = OperatorConfig(
        redis_url=args.redis_url,
        reconciler=ReconcilerSettings(resync_s=args.resync),
        worker_timeout_s=args.worker_timeout,
        peering=args.peering,
    )
    registry = kopf.OperatorRegistry()
    register(registry, config)
    asyncio.run(kopf.operator(registry=registry, **operator_kwargs(args)))
    return 0

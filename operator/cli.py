"""`lorafleet operator`: run the kopf operator (namespace-scoped by default)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os

from lorafleet.operator.reconciler import ReconcilerSettings


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
    p.add_argument("--verbose", "-v", action="store_true")
    return p


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
    namespaces = () if args.all_namespaces else (args.namespace or [os.environ.get("POD_NAMESPACE", "default")])
    # Equal priorities freeze every peer; derive distinct ones from the (unique) pod name.
    priority = args.priority
    if priority is None:
        pod = os.environ.get("HOSTNAME") or os.urandom(8).hex()
        priority = int(hashlib.sha256(pod.encode()).hexdigest()[:6], 16) if args.peering else 0
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=args.all_namespaces,
            namespaces=namespaces,
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=priority,
        )
    )
    return 0

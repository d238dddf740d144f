"""`lorafleet router`: parse flags into `RouterSettings` and serve `create_app(settings)` with uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
from pathlib import Path
from types import MappingProxyType

from lorafleet.cli import lora_module_arg
from lorafleet.cli_help import finish
from lorafleet.connection_guard import add_connection_flags, limits_from_args
from lorafleet.protocol import MAX_N
from lorafleet.router.discovery import parse_worker
from lorafleet.router.scheduling.policies import POLICIES
from lorafleet.router.settings import RouterSettings
from lorafleet.router.tenants import TenantRegistry, hash_api_key


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    return dict(lora_module_arg(item) for item in items)


def build_parser() -> argparse.ArgumentParser:
    d = RouterSettings()
    p = argparse.ArgumentParser(
        prog="lorafleet router", description="Adapter-aware router gateway (OpenAI API)."
    )
    p.add_argument("--host", default=d.host, help="bind address")
    p.add_argument("--port", type=int, default=d.port, help="port of the OpenAI API, /metrics and probes")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL[,admin=URL][,pool=NAME]",
        help="worker base URL (repeat); static discovery. admin=: its admin API when the worker runs with "
        "--admin-port (default: the same URL); pool=: its LoraPool, picks the token in --admin-token-dir",
    )
    p.add_argument("--discovery", choices=["static", "kubernetes"], default=d.discovery,
                   help="static: the --worker list; kubernetes: the worker pods matching --k8s-selector")
    p.add_argument("--k8s-namespace", default=d.k8s_namespace, help="namespace of the worker pods")
    p.add_argument("--k8s-selector", default=d.k8s_selector, help="label selector of the worker pods")
    p.add_argument("--k8s-port", type=int, default=d.k8s_port, help="the workers' public API port")
    p.add_argument(
        "--k8s-admin-port",
        type=int,
        default=None,
        help="the workers' admin API port (default: the pod's container port named `admin`, else --k8s-port)",
    )
    p.add_argument(
        "--redis-url", default=None, help="shared placement state and tenant limits (default: none, in-process)"
    )
    p.add_argument("--redis-timeout", type=float, default=d.redis_timeout_s,
                   help="seconds a request waits on one Redis call (background calls: 5x)")
    p.add_argument("--redis-breaker-failures", type=int, default=d.redis_breaker_failures,
                   help="Redis failures in a row that open the circuit breaker (requests then skip Redis)")
    p.add_argument("--redis-breaker-cooldown", type=float, default=d.redis_breaker_cooldown_s,
                   help="seconds between background pings while the breaker is open")
    p.add_argument(
        "--tenants-file",
        type=Path,
        default=None,
        help="YAML/JSON tenants with hashed API keys (default: none, open mode)",
    )
    p.add_argument(
        "--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
        help="adapter catalog: where a worker loads each adapter from (static mode)"
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="bearer token for the workers' admin API (every pool; fallback for --admin-token-dir); "
        "re-read when it changes",
    )
    p.add_argument(
        "--admin-token-dir",
        type=Path,
        default=None,
        help="one token file per LoraPool, named by the pool (mounted `<pool>-admin-token` Secrets); "
        "re-read when they change",
    )
    p.add_argument(
        "--metrics-token-file",
        type=Path,
        default=None,
        help="bearer token /metrics requires (Prometheus: authorization.credentials_file); with it tenant "
        "labels are names, without it /metrics is open and tenants appear as opaque t-… labels",
    )
    p.add_argument(
        "--tenant-labels",
        action="store_true",
        help="print each tenant of --tenants-file with its opaque /metrics label, then exit",
    )
    p.add_argument("--policy", choices=sorted(POLICIES), default=d.policy,
                   help="scheduling policy (lorafleet: adapter affinity, load and cache admission)")
    p.add_argument("--verify-index", action="store_true",
                   help="also decide every request with the plain O(replicas) policy and count disagreements "
                   "with the indexed one (lorafleet_router_index_checks_total); for tests and audits")
    p.add_argument(
        "--poll-interval", type=float, default=d.poll_interval_s, help="seconds between inventory polls"
    )
    p.add_argument(
        "--load-timeout", type=float, default=d.load_timeout_s, help="seconds a request waits for a cold load"
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body accepted (else 413)")
    p.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap,
                   help="largest max_tokens a request may ask for")
    p.add_argument("--max-n", type=int, default=d.max_n,
                   help=f"most choices (`n`) per prompt a request may ask for (default {d.max_n}, the worker's limit)")
    add_connection_flags(p, d.connection_limits)
    p.add_argument("--http-server", choices=["router", "uvicorn"], default="router" if d.fast_http else "uvicorn",
                   help="router: the proxied routes served by the router's own protocol on httptools (least CPU per "
                   "request and token); uvicorn: every request through uvicorn's ASGI cycle (router/fast_http.py)")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="router processes sharing the port (SO_REUSEPORT), one per core; state is shared only "
        "through --redis-url (router/processes.py)",
    )
    p.add_argument(
        "--hash-api-key",
        action="store_true",
        help="read an API key on stdin, print its sha256 for a tenants file",
    )
    return finish(p, {
        "Server": ["--host", "--port", "--processes", "--http-server", "--log-level"],
        "Workers and discovery": ["--worker", "--discovery", "--k8s-namespace", "--k8s-selector", "--k8s-port",
                                  "--k8s-admin-port", "--lora-modules", "--admin-token-file", "--admin-token-dir",
                                  "--poll-interval", "--load-timeout"],
        "Placement store and limits (Redis)": ["--redis-url", "--redis-timeout", "--redis-breaker-failures",
                                               "--redis-breaker-cooldown"],
        "Tenants and access": ["--tenants-file", "--metrics-token-file", "--tenant-labels", "--hash-api-key"],
        "Routing": ["--policy", "--verify-index"],
        "Request limits": ["--max-body-bytes", "--max-tokens-cap", "--max-n"],
        "Client connections": ["--header-timeout", "--body-timeout", "--keep-alive-timeout",
                               "--max-client-connections", "--max-server-connections"],
    })


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Raises OSError for an unreadable token file or folder, ValueError for a bad --worker."""
    for w in args.worker:
        parse_worker(w)
    if args.admin_token_file is not None:
        args.admin_token_file.read_text()  # fail at start-up, not at the first cold load
    if args.metrics_token_file is not None and not args.metrics_token_file.read_text().strip():
        raise ValueError(f"--metrics-token-file {args.metrics_token_file}: the file is empty")
    if args.admin_token_dir is not None and not args.admin_token_dir.is_dir():
        raise NotADirectoryError(f"--admin-token-dir {args.admin_token_dir}: not a directory")
    if not 1 <= args.max_n <= MAX_N:
        raise ValueError(f"--max-n {args.max_n}: must be in 1..{MAX_N}, the most choices a worker serves")
    return RouterSettings(
        host=args.host,
        port=args.port,
        discovery=args.discovery,
        workers=tuple(args.worker),
        k8s_namespace=args.k8s_namespace,
        k8s_selector=args.k8s_selector,
        k8s_port=args.k8s_port,
        k8s_admin_port=args.k8s_admin_port,
        redis_url=args.redis_url,
        redis_timeout_s=args.redis_timeout,
        redis_breaker_failures=args.redis_breaker_failures,
        redis_breaker_cooldown_s=args.redis_breaker_cooldown,
        tenants_file=args.tenants_file,
        lora_modules=MappingProxyType(parse_lora_modules(args.lora_modules)),
        admin_token_file=args.admin_token_file,
        admin_token_dir=args.admin_token_dir,
        metrics_token_file=args.metrics_token_file,
        policy=args.policy,
        verify_index=args.verify_index,
        poll_interval_s=args.poll_interval,
        load_timeout_s=args.load_timeout,
        max_body_bytes=args.max_body_bytes,
        max_tokens_cap=args.max_tokens_cap,
        max_n=args.max_n,
        connection_limits=limits_from_args(args),
        fast_http=args.http_server == "router",
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.hash_api_key:
        print(hash_api_key(sys.stdin.readline()))
        return 0
    if args.tenant_labels:
        if args.tenants_file is None:
            print("lorafleet router: --tenant-labels needs --tenants-file", file=sys.stderr)
            return 2
        for name, label in sorted(TenantRegistry.from_file(args.tenants_file).labels().items()):
            print(f"{label}\t{name}")
        return 0
    try:
        settings = settings_from_args(args)
    except (OSError, ValueError, argparse.ArgumentTypeError) as exc:
        print(f"lorafleet router: {exc}", file=sys.stderr)
        return 2
    if settings.discovery == "static" and not settings.workers:
        print("lorafleet router: static discovery needs at least one --worker URL", file=sys.stderr)
        return 2
    if args.processes < 1:
        print("lorafleet router: --processes must be at least 1", file=sys.stderr)
        return 2
    if settings.tenants_file is None:
        print(
            "lorafleet router: no --tenants-file given: running OPEN (no API keys) — local use only",
            file=sys.stderr,
        )
    if args.processes > 1:
        from functools import partial

        from lorafleet.router.processes import run_processes

        if settings.redis_url is None:
            print(
                f"lorafleet router: {args.processes} processes without --redis-url: each has its own "
                "placement view and tenant limits (a tenant gets that many times its limit)",
                file=sys.stderr,
            )
        return run_processes(args.processes, settings.host, settings.port, partial(serve, argv))
    serve(argv, None)
    return 0


def serve(argv: list[str], sock: socket.socket | None) -> None:
    """One router process: on `sock` (a `--processes` child's SO_REUSEPORT socket), else on --host/--port."""
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from lorafleet.router.api import create_app
    from lorafleet.router.fast_http import server_config

    # proxy_headers off: nothing in the router reads the client's address or scheme, and uvicorn's
    # middleware for them would wrap every request.
    config = server_config(create_app(settings), settings, log_level=args.log_level, access_log=False,
                           proxy_headers=False)
    # Start-up's objects (modules, the app) out of the cycle collector: its full collections would
    # otherwise walk them all, on the loop that relays every request.
    gc.collect()
    gc.freeze()
    # Young collections every 10,000 allocations rather than 700: a request's objects are freed
    # by reference counting, so the young generation holds mostly the requests in flight, walked
    # ~14x less often (a collection's cost does not grow with the threshold).
    gc.set_threshold(10_000, *gc.get_threshold()[1:])
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)

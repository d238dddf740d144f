"""`lorafleet router`: parse flags into `RouterSettings` and serve `create_app(settings)` with uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path
from types import MappingProxyType

from lorafleet.cli import lora_module_arg
from lorafleet.protocol import MAX_N
from lorafleet.router.discovery import parse_worker
from lorafleet.router.scheduling.policies import POLICIES
from lorafleet.router.settings import RouterSettings
from lorafleet.router.tenants import hash_api_key


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    return dict(lora_module_arg(item) for item in items)


def build_parser() -> argparse.ArgumentParser:
    d = RouterSettings()
    p = argparse.ArgumentParser(
        prog="lorafleet router", description="Adapter-aware router gateway (OpenAI API)."
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL[,admin=URL][,pool=NAME]",
        help="worker base URL (repeat); static discovery. admin=: its admin API when the worker runs with "
        "--admin-port (default: the same URL); pool=: its LoraPool, picks the token in --admin-token-dir",
    )
    p.add_argument("--discovery", choices=["static", "kubernetes"], default=d.discovery)
    p.add_argument("--k8s-namespace", default=d.k8s_namespace)
    p.add_argument("--k8s-selector", default=d.k8s_selector, help="label selector of the worker pods")
    p.add_argument("--k8s-port", type=int, default=d.k8s_port, help="the workers' public API port")
    p.add_argument(
        "--k8s-admin-port",
        type=int,
        default=None,
        help="the workers' admin API port (default: the pod's container port named `admin`, else --k8s-port)",
    )
    p.add_argument(
        "--redis-url", default=None, help="shared placement state and tenant limits; none: in-process"
    )
    p.add_argument(
        "--tenants-file",
        type=Path,
        default=None,
        help="YAML/JSON tenants with hashed API keys; none: open mode",
    )
    p.add_argument(
        "--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="adapter catalog (static mode)"
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
    p.add_argument("--policy", choices=sorted(POLICIES), default=d.policy)
    p.add_argument(
        "--poll-interval", type=float, default=d.poll_interval_s, help="seconds between inventory polls"
    )
    p.add_argument(
        "--load-timeout", type=float, default=d.load_timeout_s, help="seconds a request waits for a cold load"
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap)
    p.add_argument("--max-n", type=int, default=d.max_n,
                   help=f"most choices (`n`) per prompt a request may ask for (default {d.max_n}, the worker's limit)")
    p.add_argument("--log-level", default="info")
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
    return p


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Raises OSError for an unreadable token file or folder, ValueError for a bad --worker."""
    for w in args.worker:
        parse_worker(w)
    if args.admin_token_file is not None:
        args.admin_token_file.read_text()  # fail at start-up, not at the first cold load
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
        tenants_file=args.tenants_file,
        lora_modules=MappingProxyType(parse_lora_modules(args.lora_modules)),
        admin_token_file=args.admin_token_file,
        admin_token_dir=args.admin_token_dir,
        policy=args.policy,
        poll_interval_s=args.poll_interval,
        load_timeout_s=args.load_timeout,
        max_body_bytes=args.max_body_bytes,
        max_tokens_cap=args.max_tokens_cap,
        max_n=args.max_n,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.hash_api_key:
        print(hash_api_key(sys.stdin.readline()))
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

    config = uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level, access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)

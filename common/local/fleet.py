"""`lorafleet up`: a whole fleet on this machine, no cluster and no GPU needed.

    demo assets (made once, cached) ─┐
    worker 0, worker 1 (child processes, each its own process group, loopback ports)
    router (in this process, port 8000)  ←── clients (OpenAI API)
    control loop (in this process): the operator's reconciler and placement `plan()` over the
        workers' admin API, fed by `lorafleet adapters apply`, publishing to the placement store
    placement store: Redis when one answers, else in-process (shared by router and control loop)

Ctrl-C or SIGTERM stops the router, then every worker's process group (SIGTERM, then SIGKILL after a
grace period); workers also die with this process if it is killed outright (Linux PDEATHSIG).
The command line is in `local_fleet_options`, the worker processes in `local_workers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import httpx

from lorafleet.local import process_group
from lorafleet.local.fleet_lock import FleetLock, FleetLocked
from lorafleet.local.options import POOL, SERVED_NAME, UpOptions, build_parser, options_from_args
from lorafleet.local.preflight import (
    FleetError,
    check_device,
    check_ports,
    clear_redis_prefix,
    detect_store,
    ensure_assets,
    pick_worker_ports,
    seed_adapter_volume,
)
from lorafleet.local.router import RouterServer
from lorafleet.local.run_dir import FleetState, RunDir, WorkerEntry
from lorafleet.local.workers import WorkerProc, wait_ready, worker_argv, worker_env

log = logging.getLogger("lorafleet.up")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = options_from_args(args)
        return asyncio.run(run(options))
    except FleetError as exc:
        print(f"lorafleet up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130


# ---- the fleet ------------------------------------------------------------------------------------


async def run(options: UpOptions) -> int:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)

    run_dir = RunDir(options.run_dir.resolve())
    try:  # first of all: a second `up` here must not touch the running fleet's files
        lock = FleetLock.acquire(run_dir.root, options.host, options.port)
    except FleetLocked as exc:
        raise FleetError(str(exc)) from None
    try:
        return await _run(options, run_dir, stopped)
    finally:
        lock.release()


async def _run(options: UpOptions, run_dir: RunDir, stopped: asyncio.Event) -> int:
    devices = check_device(options.device, options.workers)
    worker_ports = pick_worker_ports(options.host, options.port, options.workers, options.worker_port)
    check_ports(options.host, options.port, worker_ports)
    assets = await asyncio.to_thread(ensure_assets, options.assets.resolve())
    if stopped.is_set():
        return 130
    run_dir.create()
    run_dir.clear_runtime()
    demo = seed_adapter_volume(assets, run_dir.adapters)
    token = run_dir.new_token()

    workers = [
        WorkerProc(f"{options.host}:{port}", f"http://{options.host}:{port}",
                   worker_argv(options, run_dir, assets / "model", port, devices[i], devices.count(devices[i])),
                   worker_env(options.workers * options.tensor_parallel_size, run_dir.adapter_cache / str(i)),
                   run_dir.logs / f"worker-{i}.log")
        for i, port in enumerate(worker_ports)
    ]
    redis_url = detect_store(options.redis_url)
    prefix = f"lorafleet-local:{options.port}"
    fleet = _Fleet(options, run_dir, workers, token, redis_url, prefix, demo)
    try:
        return await fleet.serve(stopped)
    finally:
        await fleet.shutdown()


@dataclass(slots=True)
class _Fleet:
    options: UpOptions
    run_dir: RunDir
    workers: list[WorkerProc]
    token: str
    redis_url: str | None
    prefix: str
    demo: list[str]
    router: RouterServer | None = None
    router_catalog: dict[str, str] | None = None  # the router's own catalog (updated in place)
    controller: object | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    http: httpx.AsyncClient | None = None
    store: object | None = None

    async def serve(self, stopped: asyncio.Event) -> int:
        from lorafleet.local.controller import NAMESPACE, LocalController, worker_urls
        from lorafleet.operator.pool_state import PodState
        from lorafleet.operator.reconciler import PoolReconciler
        from lorafleet.operator.spec import parse_pool
        from lorafleet.operator.worker_client import WorkerClient
        from lorafleet.placement_store import MemoryPlacementStore, RedisPlacementStore

        o = self.options
        if self.redis_url:
            await asyncio.to_thread(clear_redis_prefix, self.redis_url, self.prefix)
        self.http = httpx.AsyncClient()
        for w in self.workers:
            w.start()
        print(f"Starting {len(self.workers)} workers ({o.device}) and the router; logs in {self.run_dir.logs}",
              file=sys.stderr)
        await wait_ready(self.workers, self.http, stopped, o.ready_timeout_s)
        if stopped.is_set():
            return 130

        # The placement store: Redis shared by router and control loop, or one in-process object.
        memory = None
        if self.redis_url:
            self.store = RedisPlacementStore.from_url(self.redis_url, self.prefix)
        else:
            memory = self.store = MemoryPlacementStore()
        # The pool as a LoraPool's spec would give it. Any bucket and Hub owner is allowed: on one's
        # own machine there is no one else's allow-list to keep (the workers fetch with the caller's
        # AWS and HF environment).
        pool = parse_pool(NAMESPACE, POOL, {
            "image": "local", "model": {"path": str(o.assets / "model"), "servedName": SERVED_NAME},
            "replicas": len(self.workers),
            "engine": {"maxLoras": o.max_loras, "maxCpuLoras": o.max_cpu_loras, "maxLoraRank": o.max_lora_rank,
                       "device": o.device},
            "adapterVolume": {"mountPath": str(self.run_dir.adapters)},
            "sources": {"allowedBuckets": ["*"], "allowedHubOwners": ["*"]},
        })
        reconciler = PoolReconciler(NAMESPACE, POOL, WorkerClient.create(), None, self.store,
                                    LocalController.settings(), url_of=worker_urls({w.name: w.url for w in self.workers}))
        reconciler.set_pool(pool, self.token)
        for w in self.workers:
            reconciler.observe_pod(PodState(w.name, o.host, ready=True, draining=False))
        for name in self.demo:
            self.run_dir.write_desired(name, {"pool": POOL, "source": name, "replicas": {"min": 1, "max": 2}}, 1)
        controller = self.controller = LocalController(reconciler, self.run_dir)
        self.tasks.append(asyncio.create_task(controller.run(stopped)))
        self.tasks.append(asyncio.create_task(self.watch_workers(reconciler, stopped)))

        await self.start_router(memory)
        await self.wait_placed(controller, stopped)
        if stopped.is_set():
            return 130
        self.run_dir.write_state(FleetState(
            pid=os.getpid(), router_url=self.router_url, model=SERVED_NAME, pool=POOL, device=o.device,
            store=self.redis_url or "embedded", adapter_root=str(self.run_dir.adapters),
            workers=tuple(WorkerEntry(w.name, w.url, w.child.pid if w.child else 0, str(w.log_path)) for w in self.workers),
        ))
        print(banner(self, controller.placement()), flush=True)
        await stopped.wait()
        print("\nStopping the local fleet...", file=sys.stderr, flush=True)
        return 0

    @property
    def router_url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    async def start_router(self, memory) -> None:
        from lorafleet.local.controller import NAMESPACE
        from lorafleet.router.api import create_app
        from lorafleet.router.settings import RouterSettings

        o = self.options
        settings = RouterSettings(
            host=o.host, port=o.port, workers=tuple(w.url for w in self.workers),
            # No static catalog: the control loop publishes it to the store, so that a deleted adapter
            # leaves the router's catalog too (static entries would stay loadable).
            redis_url=self.redis_url, redis_prefix=self.prefix, placement_scope=NAMESPACE,
            admin_token=self.token, poll_interval_s=1.0,
        )
        app = create_app(settings, store=memory)
        self.router = RouterServer(app, o.host, o.port, o.log_level)
        await self.router.start()
        self.router_catalog = app.state.gateway.catalog  # built by the app's startup, done by now

    async def wait_placed(self, controller, stopped: asyncio.Event) -> None:
        """Until every demo adapter is Ready and the router routes to the workers, lists them and has
        them in its catalog. /v1/models lists what the workers hold too, but only the catalog lets
        the router cold-load an adapter (a composed request needs its adapters on one worker); with
        Redis the catalog reaches the router at its next store exchange, up to a poll later."""
        assert self.http is not None
        deadline = time.monotonic() + self.options.ready_timeout_s
        while not stopped.is_set():
            phases = controller.phases()
            placed = bool(phases) and all(phases.get(n) == "Ready" for n in self.demo)
            router_ok = False
            if placed:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    ready = (await self.http.get(f"{self.router_url}/ready", timeout=1.0)).status_code == 200
                    models = (await self.http.get(f"{self.router_url}/v1/models", timeout=1.0)).json()["data"]
                    router_ok = (ready and set(self.demo) <= {m["id"] for m in models}
                                 and set(self.demo) <= (self.router_catalog or {}).keys())
            if placed and router_ok:
                return
            if time.monotonic() > deadline:
                raise FleetError(f"adapters not placed after {self.options.ready_timeout_s:g}s: {phases}")
            await asyncio.sleep(0.2)

    async def watch_workers(self, reconciler, stopped: asyncio.Event) -> None:
        """Restart a worker that dies (a few times); the reconciler reloads its adapters (drift repair)."""
        from lorafleet.operator.pool_state import PodState

        assert self.http is not None
        while not stopped.is_set():
            for w in self.workers:
                if w.child is None or stopped.is_set():
                    continue
                if not w.child.alive():
                    reconciler.remove_pod(w.name)
                    if w.restarts >= 3:
                        log.error("worker %s exited again (code %s); giving up on it. Last log lines:\n%s",
                                  w.name, w.child.process.returncode, w.child.log_tail())
                        w.child = None
                        continue
                    log.warning("worker %s exited (code %s); restarting it", w.name, w.child.process.returncode)
                    w.restarts += 1
                    w.start()
                    continue
                if not w.ready:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await self.http.get(f"{w.url}/ready", timeout=1.0)).status_code == 200:
                            w.ready = True
                            reconciler.observe_pod(PodState(w.name, self.options.host, ready=True, draining=False))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopped.wait(), 0.5)

    async def shutdown(self) -> None:
        """Router first (no new requests), then the control loop, then every worker's process group."""
        if self.router is not None:
            await self.router.stop()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task
        await asyncio.to_thread(process_group.stop, [w.child for w in self.workers if w.child is not None])
        if self.controller is not None:
            with contextlib.suppress(Exception):
                await self.controller.reconciler.workers.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self.http is not None:
            await self.http.aclose()
        if self.redis_url:
            await asyncio.to_thread(clear_redis_prefix, self.redis_url, self.prefix)
        self.run_dir.state_file.unlink(missing_ok=True)


def banner(fleet: _Fleet, placement: dict[str, list[str]]) -> str:
    url = fleet.router_url
    names = sorted(placement)
    first = "sql" if "sql" in names else (names[0] if names else SERVED_NAME)
    lines = [
        "",
        f"lorafleet local fleet is up: router {url}/v1 (OpenAI API), {len(fleet.workers)} workers "
        f"({fleet.options.device}), state: {fleet.redis_url or 'embedded (in-process)'}",
        "",
        f"  router    {url}/v1    metrics {url}/metrics",
    ]
    for w in fleet.workers:
        held = sorted(n for n, pods in placement.items() if w.name in pods)
        lines.append(f"  worker    {w.url}    adapters: {', '.join(held) or '-'}")
    lines += [
        f"  base model {SERVED_NAME}; adapters {', '.join(names)}",
        "",
        "Try it:",
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{first}\", \"prompt\": \"SELECT name FROM\", \"max_tokens\": 16, \"temperature\": 0}}'",
        "",
        "  from openai import OpenAI",
        f"  client = OpenAI(base_url=\"{url}/v1\", api_key=\"local\")",
        f"  out = client.completions.create(model=\"{first}\", prompt=\"Hello\", max_tokens=16, temperature=0)",
        "  print(out.choices[0].text)",
        "",
        f"More adapters: put a PEFT folder in {fleet.run_dir.adapters}/ and run",
        "  lorafleet adapters apply -f adapter.yaml     (LoraAdapter manifests, as for kubectl)",
        "",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)

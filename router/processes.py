"""`lorafleet router --processes N`: N router processes on one port, each its own event loop and core.

Every process binds the port with SO_REUSEPORT, so the kernel spreads new connections over them
(evenly, by connection hash; no shared accept queue to contend for). Each process is a whole router:
its own upstream pool, placement sync, retry budget and metrics. What that means:

- placement state and tenant limits are shared only through Redis (`--redis-url`); without it every
  process has its own view and its own limits (a tenant gets N times its limit): the CLI says so;
- each process polls the workers' inventories itself (N polls per interval);
- `/metrics` answers for the process that took the scrape's connection: scrape each process, or
  sum over scrapes (Prometheus counters per process are still monotonic).

The parent only starts the processes, forwards SIGINT/SIGTERM and exits with the first failure.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
from collections.abc import Callable


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _serve_one(serve: Callable[[socket.socket], None], host: str, port: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    serve(reuseport_socket(host, port))


def run_processes(n: int, host: str, port: int, serve: Callable[[socket.socket], None]) -> int:
    """Runs `serve(sock)` in `n` processes, each on its own SO_REUSEPORT socket -> exit status."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--processes needs SO_REUSEPORT (Linux, BSD, macOS)")
    reuseport_socket(host, port).close()  # fail here, once, if the port is taken
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_serve_one, args=(serve, host, port), name=f"router-{i}") for i in range(n)]
    for p in procs:
        p.start()

    def stop(signum: int, _frame: object) -> None:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = 0
    for p in procs:
        p.join()
        if p.exitcode and not status:
            status = p.exitcode if p.exitcode > 0 else 0
            stop(0, None)
    return status

"""Before `lorafleet up` starts anything: device, ports, demo assets, Redis (a fleet already running
is refused before these, by `fleet_lock`).

Every check fails with a `FleetError` that says what to do, before any process is started.
"""

from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.local import process_group

log = logging.getLogger("lorafleet.up")


class FleetError(RuntimeError):
    """A start-up problem the user can fix; printed without a traceback."""


def check_device(device: str, workers: int) -> list[str]:
    """One device string per worker; CUDA only when asked for and present."""
    if device == "cpu":
        return ["cpu"] * workers
    if not device.startswith("cuda"):
        raise FleetError(f"--device {device!r}: use cpu or cuda")
    try:
        import torch
    except ModuleNotFoundError:
        raise FleetError("--device cuda needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise FleetError("--device cuda was asked for but no CUDA device is visible (torch.cuda.is_available() is False)")
    if ":" in device:
        return [device] * workers
    count = torch.cuda.device_count()
    return [f"cuda:{i % count}" for i in range(workers)]


def pick_worker_ports(host: str, router_port: int, workers: int, first: int | None) -> list[int]:
    """Consecutive ports from `first`, or free ones the OS picks."""
    if first is not None:
        return [first + i for i in range(workers)]
    ports: list[int] = []
    while len(ports) < workers:
        port = process_group.free_port(host)
        if port not in ports and port != router_port:
            ports.append(port)
    return ports


def check_ports(host: str, router_port: int, worker_ports: list[int]) -> None:
    if process_group.port_taken(host, router_port):
        raise FleetError(f"port {router_port} on {host} is taken (another `lorafleet up`, a vLLM server?); "
                         f"pick another with --port, e.g. `lorafleet up --port {router_port + 100}`")
    taken = [p for p in worker_ports if process_group.port_taken(host, p)]
    if taken:
        raise FleetError(f"worker port(s) {', '.join(map(str, taken))} on {host} are taken; "
                         "pick another --worker-port, or leave it out to use free ports")


def ensure_assets(folder: Path) -> Path:
    """The demo model and adapters, made once (a few seconds) with a progress bar."""
    if (folder / ".complete").exists():
        return folder
    from lorafleet.worker.demo_assets import DEMO_ADAPTERS, make_demo_assets

    steps = 2 + len(DEMO_ADAPTERS)
    print(f"Making the demo model and adapters in {folder} (first run only)...", file=sys.stderr)
    bar = ProgressBar(steps)
    make_demo_assets(folder, bar.step)
    bar.done()
    return folder


@dataclass(slots=True)
class ProgressBar:
    total: int
    width: int = 30
    count: int = 0
    tty: bool = field(default_factory=lambda: sys.stderr.isatty())

    def step(self, label: str) -> None:
        self.count += 1
        filled = self.width * self.count // self.total
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total} {label}"
        print(f"\r{line:<70}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def seed_adapter_volume(assets: Path, volume: Path) -> list[str]:
    """Copy the demo adapters onto the local adapter volume (the workers' --adapter-root)."""
    names = []
    for src in sorted((assets / "adapters").iterdir()):
        if src.is_dir():
            dst = volume / src.name
            if not dst.exists():
                shutil.copytree(src, dst)
            names.append(src.name)
    return names


def detect_store(redis_url: str | None) -> str | None:
    """`redis_url` if a Redis answers PING there within half a second, else None (embedded state)."""
    if not redis_url:
        return None
    try:
        import redis
    except ModuleNotFoundError:
        return None
    client = redis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return redis_url if client.ping() else None
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


def clear_redis_prefix(redis_url: str, prefix: str) -> None:
    """Remove this fleet's keys (the catalog has no TTL; a stale one would outlive the fleet)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    except (redis.RedisError, OSError) as exc:
        log.warning("could not clear %s:* in Redis: %s", prefix, exc)
    finally:
        client.close()

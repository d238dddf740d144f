"""One `lorafleet up` per run directory: an exclusive lock on `RUN_DIR/up.lock`, held for the
fleet's whole life, naming its holder (pid, router URL, start time).

A second `up` in the same folder is refused before it touches anything (it would otherwise clear
the running fleet's state, specs and token from under it), with a message naming the running
fleet. The lock is an `flock` on an open file: the kernel drops it when its holder exits, however
it exits, so a lock left by a dead process is simply taken over (and said so). The file itself is
never removed (removing it would let two processes lock two different files of one name).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("lorafleet.up")

LOCK_NAME = "up.lock"


class FleetLocked(RuntimeError):
    """Another live `lorafleet up` holds the run directory."""

    def __init__(self, root: Path, holder: dict[str, Any]) -> None:
        pid = holder.get("pid", "?")
        where = holder.get("router_url") or f"port {holder.get('port', '?')}"
        since = holder.get("started")
        super().__init__(
            f"a local fleet is already running from {root} (pid {pid}, router {where}"
            + (f", started {since}" if since else "")
            + f"); stop it first (Ctrl-C in its terminal, or `kill {pid}`), or use another --run-dir")
        self.holder = holder


def _read(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode()
        data = json.loads(text) if text.strip() else {}
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@dataclass(slots=True)
class FleetLock:
    path: Path
    fd: int | None

    @classmethod
    def acquire(cls, root: Path, host: str, port: int) -> FleetLock:
        """Raises FleetLocked naming the holder when a live process holds the lock."""
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # not inherited by the workers
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise FleetLocked(root, holder) from None
        previous = _read(fd)
        if previous.get("pid"):
            log.warning("taking over the lock of %s left by pid %s (no longer running)", root, previous["pid"])
        me = {"pid": os.getpid(), "host": host, "port": port, "router_url": f"http://{host}:{port}",
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        return cls(path, fd)

    def holder(self) -> dict[str, Any]:
        return _read(self.fd) if self.fd is not None else {}

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # an empty file: nobody to name
        os.close(self.fd)  # drops the flock
        self.fd = None

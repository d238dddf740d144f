"""Child processes that cannot outlive their parent: each in its own process group, stopped as a group.

Why a new session per child: Ctrl-C in a terminal signals the whole foreground group; the parent
must decide the order of shutdown, so children do not get the SIGINT directly. Why PDEATHSIG: if the
parent is SIGKILLed it cannot clean up, so on Linux the kernel sends each child SIGTERM instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec (Linux only; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path
    log_start: int = 0  # the log's size when this child started: earlier runs' lines are not its own

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last lines this child wrote (the log is appended to across runs)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def spawn(name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> Child:
    """Start `argv` in a new session (its own process group), stdout and stderr into `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        start = log.tell()
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return Child(name, process, log_path, start)


def stop(children: Sequence[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every child's group, wait up to `grace_s` in total, then SIGKILL what is left."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        # The group too: a child's own children (if any) must not outlive it.
        _signal_group(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=5.0)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    # The group id is the child's pid (new session); it may be gone already.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


def port_taken(host: str, port: int) -> bool:
    """True if something listens on (host, port). SO_REUSEADDR: a TIME_WAIT socket is not "taken"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free now (another process could take it before we bind again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

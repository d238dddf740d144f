"""An adapter's regexes (`target_modules` as a string, `rank_pattern`/`alpha_pattern` keys) matched
against the model's module names in a helper process, under a time and memory budget.

Python's `re` holds the GIL for a whole match: one pattern that backtracks catastrophically,
matched in the load's thread, stops every other thread of the worker (the engine's steps
included) until it ends, which can be minutes. In a process of its own it stops nothing: the
load's thread waits on a pipe (GIL released), and a match past `timeout_s` kills the helper and
refuses the adapter. The helper is plain CPython with `re` only (`-I -S`: no site, no project
code), started on first use and kept for the next adapter; its address space is capped
(RLIMIT_AS) so a pattern that compiles into a huge program fails there, not here.

Semantics are PEFT's, in the same `re` module: `target_modules` as a string is
`re.fullmatch(pattern, name)`; a pattern key matches a module whose dotted name ends with it,
`re.match(rf"(.*\\.)?({key})$", name)` (`peft.utils.other.get_pattern_key`).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from lorafleet.worker.lora.errors import AdapterError

FULL, SUFFIX = "full", "suffix"  # target_modules as a regex / a rank or alpha pattern key
CPU_BUDGET_S = 0.5  # CPU seconds for one adapter's patterns against all module names
WALL_TIMEOUT_S = 10.0  # a backstop on a machine too busy to give the helper its CPU seconds
START_TIMEOUT_S = 30.0  # the helper's interpreter start-up (not counted in the budget)
MEMORY_BYTES = 512 << 20  # the helper's address space
MAX_PATTERN_CHARS = 4096  # one pattern (PEFT configs hold a few dozen characters)
MAX_PATTERNS = 1024  # patterns in one adapter

_CHILD = r"""
import json, re, resource, signal, sys
limit, cpu = int(sys.argv[1]), float(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.stdout.write("ready\n")
sys.stdout.flush()
for line in sys.stdin:
    signal.setitimer(signal.ITIMER_PROF, cpu)  # SIGPROF (default action: exit) past the CPU budget
    try:
        req = json.loads(line)
        names, out = req["names"], []
        for mode, pattern in req["patterns"]:
            try:
                rx = re.compile(pattern if mode == "full" else rf"(.*\.)?({pattern})$")
                match = rx.fullmatch if mode == "full" else rx.match
                out.append([i for i, n in enumerate(names) if match(n)])
            except (re.error, RecursionError, OverflowError, ValueError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        reply = {"results": out}
    except MemoryError:
        reply = {"memory": True}
    signal.setitimer(signal.ITIMER_PROF, 0)
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""


@dataclass(frozen=True, slots=True)
class PatternResult:
    pattern: str
    hits: list[int] | None  # indices into the names matched; None: the pattern does not compile
    error: str | None = None


class RegexSandbox:
    """One helper process, one adapter's patterns at a time (`match`); thread-safe."""

    def __init__(self, cpu_budget_s: float = CPU_BUDGET_S, memory_bytes: int = MEMORY_BYTES,
                 wall_timeout_s: float = WALL_TIMEOUT_S) -> None:
        self.cpu_budget_s = cpu_budget_s
        self.memory_bytes = memory_bytes
        self.wall_timeout_s = wall_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed_at_exit = False

    def match(self, names: list[str], patterns: list[tuple[str, str]], what: str) -> list[PatternResult]:
        """For each (mode, pattern), the names it matches. `what` names the config key for errors.
        Over the time or memory budget: AdapterError "regex_budget" (the helper is restarted)."""
        if len(patterns) > MAX_PATTERNS:
            raise AdapterError("regex_budget", f"{what} has {len(patterns)} patterns, over the {MAX_PATTERNS} limit")
        for _mode, pattern in patterns:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise AdapterError("regex_budget", f"{what} pattern of {len(pattern)} characters is over the "
                                   f"{MAX_PATTERN_CHARS}-character limit")
        if not patterns:
            return []
        request = (json.dumps({"names": names, "patterns": patterns}) + "\n").encode()
        with self._lock:
            reply = self._ask(request, what)
        if reply.get("cpu"):
            raise AdapterError("regex_budget", f"{what}: matching the patterns against the model's module names took "
                               f"over {self.cpu_budget_s:g} s of CPU (a pattern that backtracks catastrophically?); "
                               "refused")
        if reply.get("memory"):
            raise AdapterError("regex_budget", f"{what}: matching the patterns ran out of the "
                               f"{self.memory_bytes >> 20} MiB budget")
        out = []
        for (_mode, pattern), result in zip(patterns, reply["results"]):
            if isinstance(result, str):
                out.append(PatternResult(pattern, None, result))
            else:
                out.append(PatternResult(pattern, result))
        return out

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD, str(self.memory_bytes), str(self.cpu_budget_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                # Its own process group: a signal to the worker's group (`lorafleet up` stopping it)
                # does not kill it under a worker that would then not reap it; it ends at the
                # worker's exit (atexit below) or, if the worker is killed, at its stdin's EOF.
                start_new_session=True,
            )
            try:
                ready = _read_line(self._proc, time.monotonic() + START_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            if ready != b"ready\n":
                self._stop()
                raise AdapterError("regex_budget", "the regex helper process did not start; retry the load")
            if not self._closed_at_exit:
                # Stopped and reaped when the worker exits: an orphan would outlive it (and, where
                # nothing reaps orphans, stay a zombie in the worker's process group).
                atexit.register(self.close)
                self._closed_at_exit = True
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def _ask(self, request: bytes, what: str) -> dict:
        proc = self._start()
        deadline = time.monotonic() + self.wall_timeout_s
        try:
            _write_all(proc, request, deadline)
            line = _read_line(proc, deadline)
        except TimeoutError:
            self._stop()
            return {"cpu": True}
        except (OSError, ValueError):
            line = b""
        if not line:  # the helper died: its CPU budget (SIGPROF) or its memory cap
            proc.wait()
            self._stop()
            return {"cpu": True} if proc.returncode == -signal.SIGPROF else {"memory": True}
        return json.loads(line)


def _write_all(proc: subprocess.Popen, data: bytes, deadline: float) -> None:
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    view = memoryview(data)
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_WRITE)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError
            view = view[os.write(fd, view):]


def _read_line(proc: subprocess.Popen, deadline: float) -> bytes:
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    parts: list[bytes] = []
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            parts.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(parts)

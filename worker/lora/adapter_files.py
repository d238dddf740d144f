"""Opening an adapter's files: regular files only, inside the adapter's bound, within their size cap.

A file of the adapter may be a symlink (a Hugging Face cache snapshot links into `blobs/`), but
what it resolves to must lie inside the bound (the worker's adapter root for runtime loads, else
the adapter's own folder): a link to `/etc/shadow`, another tenant's folder or a device is
refused. The check is made on the file actually opened (`/proc/self/fd`), so swapping a link
between a check and the read changes nothing. Opening never blocks (O_NONBLOCK: a FIFO is
refused, not waited on), and sizes are checked with `fstat` before a byte is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lorafleet.worker.lora.errors import AdapterError

MAX_CONFIG_BYTES = 256 << 10  # adapter_config.json (PEFT writes ~1.5 KB; per-layer patterns stay far below)


def within(path: str, bound: str) -> bool:
    return path == bound or path.startswith(bound.rstrip(os.sep) + os.sep)


def open_checked(path: Path, bound: Path, name: str) -> int:
    """A read-only descriptor of `path`, a regular file that resolves inside `bound` (a real path);
    AdapterError otherwise. `name` is how the file is named in messages (never a server path)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise AdapterError("missing_file", f"{name} does not exist (or is a broken link)") from None
    except OSError as exc:
        raise AdapterError("unreadable", f"cannot open {name}: {exc.strerror or exc}") from None
    try:
        real = _real_path(fd, path)
        if not within(real, str(bound)):
            raise AdapterError("link_outside_root", f"{name} is a link that resolves outside the adapter's folder "
                               "(or the adapter root); refused")
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise AdapterError("not_regular_file", f"{name} is not a regular file; refused")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _real_path(fd: int, path: Path) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no procfs: resolve the name (racy against a link swapped meanwhile, but still confined)
        return os.path.realpath(path)


def read_small(path: Path, bound: Path, name: str, max_bytes: int) -> bytes:
    """All of a small file (`adapter_config.json`), refused before reading if over `max_bytes`."""
    fd = open_checked(path, bound, name)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise AdapterError("too_large", f"{name} is {size} bytes, over the {max_bytes}-byte cap")
        parts, got = [], 0
        while chunk := os.read(fd, max_bytes + 1 - got):
            parts.append(chunk)
            got += len(chunk)
            if got > max_bytes:  # grew since the fstat
                raise AdapterError("too_large", f"{name} is over the {max_bytes}-byte cap")
        return b"".join(parts)
    except OSError as exc:
        raise AdapterError("unreadable", f"cannot read {name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)

"""How fast this machine reads an adapter-sized file whose pages are not cached, by read strategy.

    python -m bench.disk_read [--mib 80] [--repeats 3] [--dir DIR] [--out FILE]

The cold adapter load (`bench.adapter_load`, target 50 ms for 80 MiB) is bounded below by the disk;
this measures that bound, and whether reading with more I/O in flight lifts it:

  read()               one `readinto` of the whole file (the kernel's own readahead, one request
                       stream).
  mmap, touched        the file mapped (MADV_WILLNEED) and one byte of every page read in order: how
                       the packing read a cold file until `file_bytes.read_file` replaced the mapping.
  fadvise, then mmap   `posix_fadvise(WILLNEED)` over the file in PIECE pieces from one thread (each
                       call queues its reads and returns), then the mapped pages touched as above.
  N threads pread      N threads claim PIECE pieces in file order and `preadv` them into their own
                       scratch buffer: N requests in flight.
  N threads O_DIRECT   as N threads pread, the file opened O_DIRECT (page-aligned buffers): the disk
                       straight into the buffers, past the page cache and its readahead.
  N threads + mmap     those threads started, and the main thread touching the mapped pages at once
                       (a load packing the file while a prefetch reads ahead of it).

Before each trial the file is fsynced and dropped from the page cache (`posix_fadvise(DONTNEED)`,
no root needed); `cached` is the share of its pages still cached when the trial began (mincore).
Prints a table; writes JSON rows {strategy, threads, piece_kib, ms_median, ms_all, gb_per_s, cached_max}
(bench/results/disk-read-h200.json: the H200 machine's disk, docs/benchmarks-history.md "Cold adapter loads").
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.adapter_folder import cached_fraction

PAGE = mmap.PAGESIZE


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_once(path: Path, size: int) -> None:
    buf = bytearray(size)
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(buf), 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                break
            done += n


def touch_mapped(path: Path) -> int:
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    m.madvise(mmap.MADV_WILLNEED)
    total = sum(m[i] for i in range(0, len(m), PAGE))  # one byte a page, in order
    m.close()
    return total


def fadvise_pieces(path: Path, size: int, piece: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(0, size, piece):
            os.posix_fadvise(fd, off, min(piece, size - off), os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def direct_ok(path: Path) -> bool:
    """Whether this file system takes O_DIRECT (tmpfs, for one, refuses it)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        return False
    return True


def start_preads(path: Path, size: int, threads: int, piece: int, direct: bool = False) -> list[threading.Thread]:
    """`threads` threads claiming `piece`-byte pieces in file order, each `preadv` into its own
    buffer. `direct`: the file opened O_DIRECT, the disk straight into page-aligned buffers (an
    anonymous mapping), past the page cache."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    claim = itertools.count()
    left = [threads]
    lock = threading.Lock()

    def work() -> None:
        scratch = mmap.mmap(-1, piece) if direct else bytearray(piece)
        with memoryview(scratch) as view:
            while (off := next(claim) * piece) < size:
                os.preadv(fd, [view], off)
        with lock:
            left[0] -= 1
            if left[0] == 0:
                os.close(fd)

    pool = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    return pool


def strategies(path: Path, size: int) -> dict[tuple[str, int, int], Callable[[], object]]:
    out: dict[tuple[str, int, int], Callable[[], object]] = {
        ("read()", 1, 0): lambda: read_once(path, size),
        ("mmap, touched", 1, 0): lambda: touch_mapped(path),
    }
    for piece_kib in (128, 1024):
        out[("fadvise, then mmap", 1, piece_kib)] = lambda p=piece_kib: (fadvise_pieces(path, size, p << 10),
                                                                          touch_mapped(path))
    for threads in (2, 4, 8, 16):
        for piece_kib in (1024, 4096):
            out[("threads pread", threads, piece_kib)] = lambda n=threads, p=piece_kib: [
                t.join() for t in start_preads(path, size, n, p << 10)]
    if direct_ok(path):
        for threads in (1, 4, 8, 16):
            for piece_kib in (1024, 4096, 16384):
                out[("threads O_DIRECT", threads, piece_kib)] = lambda n=threads, p=piece_kib: [
                    t.join() for t in start_preads(path, size, n, p << 10, direct=True)]
    for threads in (4, 8):
        def both(n: int = threads) -> None:
            pool = start_preads(path, size, n, 1 << 20)
            touch_mapped(path)
            for t in pool:
                t.join()
        out[("threads + mmap", threads, 1024)] = both
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the file is written (default: the temp dir)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/disk-read.json"))
    args = ap.parse_args()
    size = args.mib << 20
    work = Path(tempfile.mkdtemp(prefix="disk-read-", dir=args.dir))
    path = work / "adapter_model.safetensors"
    path.write_bytes(os.urandom(size))
    rows = []
    try:
        plan = strategies(path, size)
        times: dict[tuple[str, int, int], list[float]] = {key: [] for key in plan}
        cached: dict[tuple[str, int, int], list[float]] = {key: [] for key in plan}
        for _ in range(args.repeats):  # interleaved, so drift hits every strategy alike
            for key, fn in plan.items():
                drop(path)
                cached[key].append(cached_fraction(path) or 0.0)
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
        print(f"\n{args.mib} MiB file in {work}, {args.repeats} repeats, medians")
        print(f"{'strategy':<22} {'threads':>7} {'piece KiB':>9} {'ms':>8} {'GB/s':>6} {'cached':>6}")
        for (name, threads, piece_kib), ts in times.items():
            ms = 1e3 * statistics.median(ts)
            c = max(cached[(name, threads, piece_kib)])
            rows.append({"strategy": name, "threads": threads, "piece_kib": piece_kib, "ms_median": round(ms, 2),
                         "ms_all": [round(1e3 * t, 2) for t in ts], "gb_per_s": round(size / ms / 1e6, 3),
                         "cached_max": round(c, 3)})
            print(f"{name:<22} {threads:>7} {piece_kib:>9} {ms:>8.1f} {size / ms / 1e6:>6.2f} {c:>6.2f}")
    finally:
        path.unlink(missing_ok=True)
        work.rmdir()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"mib": args.mib, "dir": str(work), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

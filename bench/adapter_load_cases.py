"""The adapter-load benchmark's load timings: disk->GPU, the disk read alone, a re-read, the digest, CPU->GPU.

Each case goes through the registry's own methods (nothing about loading is reimplemented):

  disk->gpu    a fresh folder per repeat: registry.read + registry.register (what
               LLMEngine.load_adapter does: read validates, digests and packs the adapter into
               the slot layout on the GPU and checks it for NaN/Inf there; register files it)
               and registry.activate, until the compute stream has passed the slot's fill (when
               a step could use the adapter). Target <= 50 ms. `disk`: from the start to the
               last byte read (PieceClock); `after_disk`: from then to the end. The layout's copy
               back into the pinned CPU cache is not waited for by the load; `host_copy_done` is
               when a full device sync after that returns. The file is fsynced and
               dropped from the page cache (posix_fadvise DONTNEED, no root needed) and mincore
               says how much of it was still cached when the read began (`cached_fraction`).
  disk->gpu, page cache warm    the same on a freshly written folder left in the page cache.
  disk read alone    the weights file read with the page cache dropped by the reader a load uses
               (`file_bytes.read_file`) and nothing else: what the disk itself costs in this run.
  sha256 digest    adapter_digest alone on a cached file (inside every read it runs in a thread,
               over the same bytes read, once the file is parsed, packed and checked).
  cpu->gpu     an adapter already registered (pinned in the CPU cache on CUDA), its GPU copy
               of the layout let go (as for an adapter that comes back from the CPU cache):
               registry.activate + sync. Target <= 5 ms.

row() makes a case's row from its repeats: {case, ms_median, ms_p90, adapter_mib, repeats, ms_all, ...}.
"""

from __future__ import annotations

import math
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from bench.adapter_folder import cached_fraction, write_folder
from bench.engine_workload import sync
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.lora import file_bytes
from lorafleet.worker.lora.adapter import UPLOAD_CHUNK_BYTES, WEIGHTS_FILE, adapter_digest
from lorafleet.worker.lora.file_bytes import read_file

RANK = 16
PREFIX = "adapter-load-"  # names that cannot clash with bench/engine.py's a0, a1, ...
TARGET_MS = {"disk->gpu": 50.0, "cpu->gpu": 5.0}


# -- statistics and rows ------------------------------------------------------------------------
def p90(values: list[float]) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


def row(case: str, seconds: list[float], mib: float, **extra) -> dict:
    ms = [1e3 * s for s in seconds]
    out = {"case": case, "ms_median": round(statistics.median(ms), 3), "ms_p90": round(p90(ms), 3),
           "adapter_mib": round(mib, 2), "repeats": len(ms), "ms_all": [round(v, 2) for v in ms]}
    if case in TARGET_MS:
        out["target_ms"] = TARGET_MS[case]
    return {**out, **extra}


def medians_ms(samples: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    return {f"{k}_ms_median": round(1e3 * statistics.median(s[k] for s in samples), 3) for k in keys}


# -- disk -> GPU and CPU -> GPU -----------------------------------------------------------------
class PieceClock:
    """When the last byte of a read landed: notes each return from `file_bytes._read_piece` (the one
    function every read request of `FileRead` runs, on the read's own threads, started inside) with
    a profile hook on the threads started while it is entered; nothing in lorafleet is replaced.
    Inside a load this splits its time into the disk's (`t0` to the last byte) and what comes
    after, in the same trial: the read-alone case is timed in trials of its own, on a disk whose
    speed drifts from trial to trial."""

    def __init__(self) -> None:
        self.ends: list[float] = []  # appended by the read's threads (list.append is atomic)
        self._code = file_bytes._read_piece.__code__

    @property
    def last(self) -> float:
        return max(self.ends)

    def _hook(self, frame, event: str, arg) -> None:
        if event == "return" and frame.f_code is self._code:
            self.ends.append(time.perf_counter())

    def __enter__(self) -> PieceClock:
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        threading.setprofile(None)


def disk_to_gpu(engine: LLMEngine, folder: Path, name: str) -> dict[str, float]:
    """LLMEngine.load_adapter's two calls (read, register), then activate; unloads it after."""
    reg = engine.registry
    cached = cached_fraction(folder / WEIGHTS_FILE)
    sync()
    with PieceClock() as clock:
        t0 = time.perf_counter()
        weights = reg.read(str(folder))
        t1 = time.perf_counter()
    reg.register(name, weights)
    t2 = time.perf_counter()
    reg.activate([name], {name})
    t3 = time.perf_counter()
    if torch.cuda.is_available():  # the compute stream: a step queued now would run with the adapter
        torch.cuda.current_stream().synchronize()
    t4 = time.perf_counter()
    sync()  # and the copy back into the CPU cache, which the load does not wait for
    t5 = time.perf_counter()
    engine.unload_adapter(name)
    return {"total": t4 - t0, "read": t1 - t0, "disk": clock.last - t0, "after_disk": t4 - clock.last,
            "register": t2 - t1, "activate": t4 - t2, "activate_host": t3 - t2,
            "host_copy_done": t5 - t0, "cached": -1.0 if cached is None else cached, "mib": weights.nbytes / 2**20}


def disk_case(engine: LLMEngine, work: Path, tensors: dict, repeats: int, drop_cache: bool) -> dict:
    label = "disk->gpu" if drop_cache else "disk->gpu, page cache warm"
    evictions, samples = engine.registry.stats.gpu_evictions, []
    for k in range(repeats):
        folder = work / f"{'cold' if drop_cache else 'warm'}-{k}"
        write_folder(folder, tensors, RANK, drop_cache)
        samples.append(disk_to_gpu(engine, folder, f"{PREFIX}{folder.name}"))
        shutil.rmtree(folder)
    cached = [s["cached"] for s in samples if s["cached"] >= 0]
    extra = medians_ms(samples, ("read", "disk", "after_disk", "register", "activate", "activate_host",
                                 "host_copy_done"))
    extra["page_cache"] = ("dropped (fsync + posix_fadvise DONTNEED)" if drop_cache else "warm (freshly written)")
    extra["cached_fraction_median"] = round(statistics.median(cached), 3) if cached else None
    extra["gpu_evictions"] = engine.registry.stats.gpu_evictions - evictions
    return row(label, [s["total"] for s in samples], samples[0]["mib"], **extra)


def disk_read_case(work: Path, tensors: dict, repeats: int, pin: bool) -> dict:
    """The weights file alone, page cache dropped, read as a load reads it (`file_bytes.read_file`:
    the same threads, pinned chunks on CUDA) with nothing else done: the disk's share of a cold load."""
    samples, mib = [], 0.0
    for k in range(repeats):
        folder = work / f"read-{k}"
        write_folder(folder, tensors, RANK, drop_cache=True)
        t0 = time.perf_counter()
        got = read_file(folder / WEIGHTS_FILE, max_bytes=1 << 40, pin=pin, chunk_bytes=UPLOAD_CHUNK_BYTES if pin else 0)
        samples.append(time.perf_counter() - t0)
        mib = len(got) / 2**20
        del got
        shutil.rmtree(folder)
    return row("disk read alone (read_file, page cache dropped)", samples, mib, pinned=pin,
               threads=file_bytes.READ_THREADS, piece_kib=file_bytes.PIECE_BYTES >> 10)


def reread_case(engine: LLMEngine, folder: Path, repeats: int) -> dict:
    """The same unchanged folder read again (an adapter evicted from the CPU cache coming back):
    its digest comes from `adapter.DIGEST_CACHE`, so no sha256; page cache warm."""
    samples = [disk_to_gpu(engine, folder, f"{PREFIX}reread-{k}") for k in range(repeats)]
    extra = medians_ms(samples, ("read", "register", "activate", "activate_host", "host_copy_done"))
    return row("disk->gpu, re-read of an unchanged folder (digest cached)", [s["total"] for s in samples],
               samples[0]["mib"], **extra)


def digest_case(folder: Path, repeats: int, mib: float) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        adapter_digest(folder)
        times.append(time.perf_counter() - t0)
    return row("sha256 digest (inside read, page cache warm)", times, mib)


def register_from(engine: LLMEngine, folder: Path, name: str) -> bool:
    """Read and register untimed: the adapter is then in the CPU cache only (its layout's GPU copy
    let go, the copy back into the cache done), as one that comes back from there. Returns whether
    it is pinned."""
    weights = engine.registry.read(str(folder))
    engine.registry.register(name, weights)
    weights.packed.release_gpu()
    weights.packed.wait_host()
    return next(iter(engine.registry.cpu[name].modules.values())).a.is_pinned()


def cpu_case(engine: LLMEngine, folder: Path, repeats: int, mib: float) -> dict:
    reg = engine.registry
    totals, hosts, pinned, evictions = [], [], False, reg.stats.gpu_evictions
    copies = None
    for k in range(repeats):
        name = f"{PREFIX}cpu-{k}"
        pinned = register_from(engine, folder, name)
        copies = len(reg.cpu[name].packed.sources) + 1  # LoraSlots.fill: one per piece + the rank table
        sync()
        t0 = time.perf_counter()
        reg.activate([name], {name})
        t1 = time.perf_counter()
        sync()
        totals.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
        engine.unload_adapter(name)
    return row("cpu->gpu", totals, mib, pinned=pinned, activate_host_ms_median=round(1e3 * statistics.median(hosts), 3),
               fill_copies=copies, gpu_evictions=reg.stats.gpu_evictions - evictions)

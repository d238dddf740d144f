"""Cold adapter loads at the seed guide's 7.8B shape (issue 9's adapter-load targets).

    python -m bench.adapter_load [--tiny] [--repeats 10] [--max-lora-rank 16] [--out FILE]

The engine is built as bench/engine.py builds it (random bf16 weights made on the GPU, loaded
through the engine's own path); the adapter is rank 16 on all 7 projections (80 MiB in bf16),
written as a real PEFT folder (adapter_config.json + adapter_model.safetensors, PEFT's tensor
names). Everything goes through the registry's own methods; nothing about loading is reimplemented:

  disk->gpu    a fresh folder per repeat: registry.read + registry.register (what
               LLMEngine.load_adapter does: read validates, digests and packs the adapter into
               the slot layout on the GPU and checks it for NaN/Inf there; register files it)
               and registry.activate, until the compute stream has passed the slot's fill (when
               a step could use the adapter). Target <= 50 ms. The layout's copy back into the
               pinned CPU cache is not waited for by the load; `host_copy_done` is when a full
               device sync after that returns. The file is fsynced and
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
  decode step, no load / decode step, prefetch each step    32 running decode requests (on one
               resident adapter when there are >= 2 GPU slots, else base-only); steps alternate
               between plain steps and steps preceded by registry.prefetch of a new adapter (the
               call LLMEngine.step makes after each forward), each with a device sync around it.
  decode step while a cold read runs    the same batch stepped on the main thread while
               registry.read of a cold folder runs in a thread (as the admin endpoint runs it),
               against steps between reads; and the read's own time beside the steps.
  prefetch call (host) / prefetch copy (side stream)    how long that prefetch call holds the
               host, and the copy's own time between CUDA events on the slots' side stream (read
               from the private `LoraSlots._copy_stream`: the registry exposes no stream).

Every adapter has a new name (so each load is a real GPU, and for disk->gpu CPU, miss) and is
unloaded again untimed, so on this script's engine slots stay free; on an engine whose slots are
full (bench/engine.py's, after its workloads) a load evicts, and rows count it (`gpu_evictions`).
One untimed load first pays for one-time costs (imports, pinned-allocator growth). Rows are
medians and p90s of the repeats: {case, ms_median, ms_p90, adapter_mib, repeats, ...}. Writes
bench/results/adapter-load-h200.json (with --tiny, a CPU smoke run, /tmp/adapter-load-tiny.json).

Slots are as wide as bench/engine.py makes them (max rank 16, the adapter's own rank);
--max-lora-rank 64 is the server's default. Either way `LoraSlots.fill` issues one copy per piece
(per column and A|B, all layers at once, plus one per pinned-buffer cut inside a piece: 18 at the
seed shape) and one for the rank table, from the CPU cache's copy already in the slot layout, so
the slot rank changes only the GPU memory reserved. The cpu->gpu row reports that count
(`fill_copies`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine import LLMEngine
from lorafleet.worker.gc_freeze import freeze_startup_objects
from lorafleet.worker.lora import file_bytes
from lorafleet.worker.lora.adapter import CONFIG_FILE, UPLOAD_CHUNK_BYTES, WEIGHTS_FILE, adapter_digest
from lorafleet.worker.lora.file_bytes import read_file
from lorafleet.worker.sequence import SamplingParams

try:  # `python -m bench.adapter_load` and `from bench.adapter_load import ...`
    from bench.engine import SEED_SHAPE, TARGETS, TINY_SHAPE, random_weights, sync
except ImportError:  # `python bench/adapter_load.py`
    from engine import SEED_SHAPE, TARGETS, TINY_SHAPE, random_weights, sync

RANK = 16
BATCH = 32
PROMPT_LEN = 128
PREFIX = "adapter-load-"  # names that cannot clash with bench/engine.py's a0, a1, ...
TARGET_MS = {"disk->gpu": 50.0, "cpu->gpu": 5.0}


# -- a PEFT folder on disk ----------------------------------------------------------------------
def peft_tensors(config: ModelConfig, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 LoRA weights under PEFT's saved names (A [r, in], B [out, r])."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for t in TARGETS:
            out, in_ = config.linear_shape(t)
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[p + ".lora_A.weight"] = torch.randn(rank, in_, generator=g, dtype=torch.bfloat16) * 0.01
            tensors[p + ".lora_B.weight"] = torch.randn(out, rank, generator=g, dtype=torch.bfloat16) * 0.01
    return tensors


def peft_config(rank: int) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "lorafleet-bench-random",
            "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "lora_dropout": 0.0,
            "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "init_lora_weights": True}


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], rank: int, drop_cache: bool) -> None:
    """Write a PEFT folder and fsync it; with `drop_cache` also ask the kernel to drop its pages."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps(peft_config(rank), indent=2))
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            if drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore); None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, 1, 1, f.fileno(), 0)  # PROT_READ, MAP_SHARED: faults nothing in
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * -(-size // page))()
            if libc.mincore(addr, size, vec) != 0:
                return None
        finally:
            libc.munmap(addr, size)
        return sum(b & 1 for b in bytes(vec)) / len(vec)
    except (OSError, AttributeError, ValueError):
        return None


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
def disk_to_gpu(engine: LLMEngine, folder: Path, name: str) -> dict[str, float]:
    """LLMEngine.load_adapter's two calls (read, register), then activate; unloads it after."""
    reg = engine.registry
    cached = cached_fraction(folder / WEIGHTS_FILE)
    sync()
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
    return {"total": t4 - t0, "read": t1 - t0, "register": t2 - t1, "activate": t4 - t2, "activate_host": t3 - t2,
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
    extra = medians_ms(samples, ("read", "register", "activate", "activate_host", "host_copy_done"))
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


# -- overlap with decode ------------------------------------------------------------------------
def read_beside_decode(engine: LLMEngine, work: Path, tensors: dict, repeats: int, mib: float) -> list[dict]:
    """Cold reads (page cache dropped) in a thread, as the admin endpoint runs them, while the
    engine keeps stepping a decode batch on this thread: the steps during each read against
    plain steps between reads, and each read's own time beside the steps."""
    resident = f"{PREFIX}beside" if engine.config.max_loras >= 2 else None
    if resident:
        register_from(engine, work / "shared", resident)
    ids = start_batch(engine, 40 * repeats, resident)
    plain, beside, reads = [], [], []
    for k in range(repeats):
        folder = work / f"beside-{k}"
        write_folder(folder, tensors, RANK, drop_cache=True)
        plain += [timed_step(engine) for _ in range(5)]
        def read(folder: Path = folder) -> None:
            t0 = time.perf_counter()
            engine.registry.read(str(folder))
            reads.append(time.perf_counter() - t0)

        thread = threading.Thread(target=read)
        thread.start()
        while thread.is_alive():
            beside.append(timed_step(engine))
        thread.join()
        shutil.rmtree(folder)
    batch = end_batch(engine, ids, resident)
    return [row("decode step, between cold reads", plain, mib, batch=batch),
            row("decode step, while a cold read runs in a thread", beside, mib, batch=batch),
            row("cold read (registry.read) in a thread beside decode steps", reads, mib)]


def end_batch(engine: LLMEngine, ids: list[int], resident: str | None) -> str:
    """Abort `start_batch`'s requests and unload its adapter; returns the batch's description."""
    for rid in ids:
        engine.abort(rid)
    if resident:
        engine.unload_adapter(resident)
    return f"{len(ids)} requests, " + (f"all on one resident rank-{RANK} adapter" if resident else "base-only")


def start_batch(engine: LLMEngine, steps: int, adapter: str | None) -> list[int]:
    """BATCH decode requests, stepped until every one of them is decoding."""
    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    adapters = ((adapter, 1.0),) if adapter else ()
    n = min(BATCH, engine.config.max_num_seqs)
    ids = [engine.add_request([(r * 7919 + j * 31) % (vocab - 10) + 10 for j in range(PROMPT_LEN)], sp, adapters)
           for r in range(n)]
    while engine.scheduler.waiting or any(s.num_uncomputed != 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # allocator, kernel selection, JIT at the decode shape
        engine.step()
    return ids


def timed_step(engine: LLMEngine) -> float:
    sync()
    t0 = time.perf_counter()
    engine.step()
    sync()
    return time.perf_counter() - t0


def timed_prefetch_step(engine: LLMEngine, name: str) -> dict[str, float]:
    """registry.prefetch(new adapter) as LLMEngine.step calls it, then one step; events on the side stream."""
    stream = getattr(engine.slots, "_copy_stream", None)  # private: the registry exposes no stream
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if stream is not None else None
    sync()
    if events:
        events[0].record(stream)
    t0 = time.perf_counter()
    done = engine.registry.prefetch([name], engine.scheduler.running_adapters())
    t1 = time.perf_counter()
    if events:
        events[1].record(stream)
    engine.step()
    sync()
    t2 = time.perf_counter()
    copy = events[0].elapsed_time(events[1]) / 1e3 if events else -1.0
    return {"step": t2 - t0, "host": t1 - t0, "copy": copy, "prefetched": float(name in done)}


def decode_cases(engine: LLMEngine, folder: Path, repeats: int, mib: float) -> list[dict]:
    resident = f"{PREFIX}resident" if engine.config.max_loras >= 2 else None
    if resident:
        register_from(engine, folder, resident)
    ids = start_batch(engine, 2 * repeats, resident)
    plain, loaded, evictions = [], [], engine.registry.stats.gpu_evictions
    for k in range(repeats):  # alternated, so both see the same context lengths
        plain.append(timed_step(engine))
        name = f"{PREFIX}prefetch-{k}"
        register_from(engine, folder, name)
        loaded.append(timed_prefetch_step(engine, name))
        engine.unload_adapter(name)
    batch = end_batch(engine, ids, resident)
    graphs = engine.runner.graphs is not None and engine.runner.graphs.enabled
    common = {"batch": batch, "cuda_graphs": graphs}
    evicted = engine.registry.stats.gpu_evictions - evictions
    copies = [s["copy"] for s in loaded if s["copy"] >= 0]
    rows = [
        row("decode step, no load", plain, mib, **common),
        row("decode step, prefetch each step", [s["step"] for s in loaded], mib, **common,
            prefetched=int(sum(s["prefetched"] for s in loaded)), gpu_evictions=evicted),
        row("prefetch call (host, inside the step above)", [s["host"] for s in loaded], mib),
    ]
    if copies:
        rows.append(row("prefetch copy (side stream, overlapping the step)", copies, mib,
                        measured="CUDA events on LoraSlots._copy_stream around the prefetch call"))
    else:
        rows.append({"case": "prefetch copy (side stream, overlapping the step)", "ms_median": None, "ms_p90": None,
                     "adapter_mib": round(mib, 2), "repeats": 0, "measured": "not measured: no CUDA side stream"})
    return rows


# -- the whole measurement ----------------------------------------------------------------------
def load_rows(engine: LLMEngine, model_config: ModelConfig, device: str, repeats: int,
              workdir: str | Path | None = None) -> list[dict]:
    """All cases on an idle engine; leaves it as found (every adapter it loads is unloaded)."""
    if engine.has_unfinished():
        raise RuntimeError("load_rows needs an idle engine: requests are still running")
    if device == "cuda" and engine.registry.slots.device.type != "cuda":
        raise RuntimeError("the engine's adapter slots are not on the GPU")
    tensors = peft_tensors(model_config, RANK)
    work = Path(tempfile.mkdtemp(prefix="adapter-load-", dir=workdir))
    try:
        warm = work / "shared"
        write_folder(warm, tensors, RANK, drop_cache=False)
        first = disk_to_gpu(engine, warm, f"{PREFIX}warmup")  # one-time costs, not counted
        mib = first["mib"]
        return [
            disk_case(engine, work, tensors, repeats, drop_cache=True),
            disk_read_case(work, tensors, repeats, pin=device == "cuda"),
            disk_case(engine, work, tensors, repeats, drop_cache=False),
            reread_case(engine, warm, repeats),
            digest_case(warm, repeats, mib),
            cpu_case(engine, warm, repeats, mib),
            *decode_cases(engine, warm, repeats, mib),
            *read_beside_decode(engine, work, tensors, repeats, mib),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_engine(tiny: bool, max_lora_rank: int) -> tuple[LLMEngine, ModelConfig, str]:
    """As bench/engine.py builds it: a config-only folder, random weights through the loading path."""
    from lorafleet.worker.demo_assets import build_tokenizer

    device = "cpu" if tiny else "cuda"
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY_SHAPE if tiny else SEED_SHAPE))
    build_tokenizer(folder)  # only to satisfy the folder layout: the benchmark feeds token ids
    model_config = ModelConfig.from_folder(folder)
    config = EngineConfig(max_loras=4, max_cpu_loras=8, max_lora_rank=max_lora_rank, max_num_seqs=BATCH,
                          max_num_batched_tokens=8192, device=device, dtype="bfloat16", max_loras_per_request=1,
                          num_kv_blocks=512 if tiny else None,
                          async_scheduling=False)  # its step timings are of synchronous steps
    engine = LLMEngine(folder, config, weights=random_weights(model_config, device))
    freeze_startup_objects()  # as the worker does once its engine is built (worker/gc_freeze.py)
    return engine, model_config, device


def print_table(rows: list[dict], out: Callable[[str], None] = print) -> None:
    out(f"\n{'case':<52} {'median ms':>10} {'p90 ms':>9} {'target':>7}  notes")
    for r in rows:
        med = "-" if r["ms_median"] is None else f"{r['ms_median']:.2f}"
        p = "-" if r["ms_p90"] is None else f"{r['ms_p90']:.2f}"
        target = f"{r['target_ms']:g}" if "target_ms" in r else ""
        skip = {"case", "ms_median", "ms_p90", "target_ms", "adapter_mib", "repeats", "ms_all"}
        notes = ", ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        out(f"{r['case']:<52} {med:>10} {p:>9} {target:>7}  {notes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU: checks the script, measures nothing")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-lora-rank", type=int, default=RANK,
                    help="slot rank (bench/engine.py uses 16; the server's default is 64)")
    ap.add_argument("--workdir", default=None, help="where adapter folders are written (default: the temp dir)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or (Path(tempfile.gettempdir()) / "adapter-load-tiny.json" if args.tiny
                       else Path(__file__).parent / "results" / "adapter-load-h200.json")
    t0 = time.perf_counter()
    engine, model_config, device = build_engine(args.tiny, args.max_lora_rank)
    print(f"engine built in {time.perf_counter() - t0:.1f}s; LoRA backend {engine.model.lora_backend}, "
          f"{engine.config.max_loras} slots at max rank {engine.config.max_lora_rank}")
    rows = load_rows(engine, model_config, device, args.repeats, args.workdir)
    print_table(rows)
    result = {
        "machine": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny smoke run)",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "shape": "tiny" if args.tiny else "seed 7.8B", "adapter_rank": RANK,
        "engine": {"max_loras": engine.config.max_loras, "max_lora_rank": engine.config.max_lora_rank,
                   "lora_backend": engine.model.lora_backend,
                   "b_layout": "rank_major"},
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f}s in all)")


if __name__ == "__main__":
    main()

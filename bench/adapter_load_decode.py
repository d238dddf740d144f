"""The adapter-load benchmark's decode steps beside loads: a prefetch each step, a cold read in a thread.

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
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch

from bench.adapter_folder import write_folder
from bench.adapter_load_cases import PREFIX, RANK, register_from, row
from bench.engine_workload import sync
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

BATCH = 32
PROMPT_LEN = 128


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

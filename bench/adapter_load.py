"""Cold adapter loads at the seed guide's 7.8B shape (issue 9's adapter-load targets).

    python -m bench.adapter_load [--tiny] [--repeats 10] [--max-lora-rank 16] [--out FILE]

The engine is built as bench/engine.py builds it (random bf16 weights made on the GPU, loaded
through the engine's own path); the adapter is rank 16 on all 7 projections (80 MiB in bf16),
written as a real PEFT folder (bench/adapter_folder.py). Everything goes through the registry's
own methods; nothing about loading is reimplemented. The rows, in order:

  bench/adapter_load_cases.py    the load timings: disk->gpu (page cache dropped; target <= 50 ms),
               the disk read alone, disk->gpu with the page cache warm, the re-read of an unchanged
               folder (digest cached), the sha256 digest, cpu->gpu (target <= 5 ms).
  bench/adapter_load_decode.py   decode steps beside loads: with and without a prefetch of a new
               adapter each step, the prefetch's host and side-stream time, and decode steps while
               a cold read runs in a thread, with that read's own time.

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
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.server.gc_freeze import freeze_startup_objects

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.adapter_folder import peft_tensors, write_folder
from bench.adapter_load_cases import (
    PREFIX,
    RANK,
    cpu_case,
    digest_case,
    disk_case,
    disk_read_case,
    disk_to_gpu,
    reread_case,
)
from bench.adapter_load_decode import BATCH, decode_cases, read_beside_decode
from bench.engine_build import SEED_SHAPE, TINY_SHAPE, random_weights


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
    freeze_startup_objects()  # as the worker does once its engine is built (worker/server/gc_freeze.py)
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

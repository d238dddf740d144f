"""What bench/serve.py serves and compares against: a model folder, adapter folders, the engine's figures.

The model is the engine benchmark's (bench/engine_build.py): the seed guide's 7.8B Llama shape on a
GPU, its tiny shape on a CPU, random weights from the same seeded generator, written as a Hugging
Face folder (config.json, model.safetensors, a tokenizer of the model's vocabulary size) that
`lorafleet worker --model` loads, or without model.safetensors (`--config-only`) for `lorafleet worker
--load-format dummy`, which makes the same weights on its device (worker/models/dummy.py). Adapters are random rank-16 PEFT folders on all 7 projections
(bench/adapter_folder.py), named a0, a1, ...

`engine_rows` runs in its own process (`python -m bench.serve_assets engine ...`, JSON on stdout)
before the worker starts, so the worker gets the whole GPU: bench/engine.py's engine and
`decode_run` at the served run's batch, prompt length and adapter counts, with the model's weights
as written (`--weights bf16`) or quantized to FP8 at load as `lorafleet worker --quantization fp8`
does (`--weights fp8`, the engine of bench/engine_fp8.py's rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def shape(device: str) -> dict:
    from bench.engine_build import SEED_SHAPE, TINY_SHAPE

    return SEED_SHAPE if device.startswith("cuda") else TINY_SHAPE


def write_model(folder: Path, device: str, weights: bool = True) -> Path:
    """The engine benchmark's random-weight model as a folder the worker loads (skipped if there);
    without `weights`, config.json and the tokenizer only, for `lorafleet worker --load-format dummy`
    (the same random weights, made on the worker's device at start-up: nothing to write or read)."""
    import torch
    from safetensors.torch import save_file

    from bench.engine_build import full_vocab_tokenizer, random_weights
    from lorafleet.worker.config import ModelConfig

    marker = folder / ".complete"
    if marker.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(shape(device))
    if not device.startswith("cuda"):
        cfg["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg))
    full_vocab_tokenizer(folder, cfg["vocab_size"])
    if not weights:
        marker.write_text("ok\n")
        return folder
    config = ModelConfig.from_folder(folder)
    gen = "cuda" if device.startswith("cuda") else "cpu"
    tensors = {name: t.to("cpu", non_blocking=False).contiguous() for name, t in random_weights(config, gen)}
    if gen == "cuda":
        torch.cuda.synchronize()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text("ok\n")
    return folder


def write_adapters(root: Path, model: Path, count: int, rank: int = 16) -> dict[str, Path]:
    """`count` random PEFT folders a0..a{count-1} under `root` (existing ones kept) -> name: path."""
    from bench.adapter_folder import peft_tensors, write_folder
    from lorafleet.worker.config import ModelConfig

    config = ModelConfig.from_folder(model)
    out = {}
    for k in range(count):
        folder = root / f"a{k}"
        if not (folder / "adapter_model.safetensors").exists():
            write_folder(folder, peft_tensors(config, rank, seed=k), rank, drop_cache=False)
        out[f"a{k}"] = folder
    return out


WEIGHTS = {"bf16": None, "fp8": "fp8"}  # a row's `weights` -> the worker's and engine's --quantization


def engine_rows(device: str, batch: int, prompt: int, new_tokens: int, adapter_counts: list[int],
                weights: str = "bf16") -> list[dict]:
    """bench/engine.py's decode_run at this batch: tokens/s per adapter count (graphs + async
    scheduling on a GPU, the worker's defaults there; eager on a CPU), with `weights` as a served
    worker holds them."""
    from bench.engine_build import build_engine, register_random_adapters
    from bench.engine_workload import adapter_sets, decode_run

    cpu = not device.startswith("cuda")
    args = argparse.Namespace(tiny=cpu, rank=16, batch=batch, modes="eager" if cpu else "async",
                              quantization=WEIGHTS[weights])
    n_slots = max(adapter_counts + [1])
    engine, model_config, load_s = build_engine(args, "cpu" if cpu else "cuda", n_slots)
    names = register_random_adapters(engine, model_config, n_slots, 16)
    if not cpu:
        engine.async_steps.enabled = True
    decode_run(engine, adapter_sets(names, n_slots, batch), 16, 4)  # JIT and allocator
    rows = []
    for d in adapter_counts:
        sets = adapter_sets(names, d, batch)
        decode_run(engine, sets, prompt, min(new_tokens, 16))  # graph capture at this composition
        res = decode_run(engine, sets, prompt, new_tokens)
        rows.append({"weights": weights, "adapters": d, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                     "tokens_per_s": res["tokens_per_s"], "decode_step_ms": res["decode_step_ms"]})
        print(f"engine {weights} {d} adapters batch {batch}: {res['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bench/serve.py's helper: write the model and adapters, or the engine's figures (JSON on stdout)")
    p.add_argument("what", choices=["engine", "write"])
    p.add_argument("--model", type=Path, help="write: the model folder")
    p.add_argument("--adapter-root", type=Path, help="write: where the adapter folders go")
    p.add_argument("--count", type=int, default=0, help="write: adapters")
    p.add_argument("--config-only", action="store_true",
                   help="write: config.json and the tokenizer, no weights (the worker runs with --load-format dummy)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--adapters", default="0,8,64")
    p.add_argument("--weights", default="bf16", choices=sorted(WEIGHTS), help="engine: bf16 as written, or fp8 at load")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.what == "write":
        write_model(args.model, args.device, weights=not args.config_only)
        adapters = write_adapters(args.adapter_root, args.model, args.count)
        print(f"model and {args.count} adapters written in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        print(json.dumps({k: str(v) for k, v in adapters.items()}))
        return 0
    rows = engine_rows(args.device, args.batch, args.prompt, args.new_tokens,
                       [int(x) for x in args.adapters.split(",") if x], args.weights)
    print(json.dumps({"rows": rows, "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

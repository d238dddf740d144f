"""bench/engine.py's `--weights` rows: FP8 (e4m3) base weights against bf16 on one card, at their byte bound.

    python -m bench engine --weights bf16,fp8 [--adapters 8,64] [--prompt-lens 128] [--new-tokens 64]
                           [--quality-model bench/.cache/trained-llama] [--out F]

For each weights kind the seed-shape engine is built in turn (random bf16 weights through the
engine's loading path; `fp8` quantizes them at load as `--quantization fp8` does), with the engine's
defaults on CUDA, random rank-16 adapters registered, then freed. Each row times one batch (base only,
then 8 and 64 distinct adapters): {weights, adapters, batch, prompt, tokens_per_s, decode_step_ms,
byte_bound_tokens_per_s, of_byte_bound, step_bytes, ...}. A row's byte bound is what one decode step
must read over the copy bandwidth measured in the same run: the weights (all but the embedding table,
of which it reads B rows; FP8 projections at one byte, their scales, the bf16 norms and lm_head), the
batch's distinct adapters (A and B of every target, at their rank) and the KV cache the batch attends
to (at the decode phase's mean context, prompt + new_tokens / 2). `summary` gives FP8's base-only
tokens/s over bf16's. `quality` is bench/fp8_quality.py on `--quality-model` (a trained model: `python -m
bench trained_model`), with the seed shape's per-projection errors. Writes
bench/results/engine-fp8-<gpu>.json. Targets (issue 53): FP8 base-only >= 1.6x bf16 at batch 64; FP8
mixed batches >= 0.9 of their byte bound; mean KL <= 0.01.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from bench.engine_build import SEED_SHAPE, TARGETS, TINY_SHAPE, build_engine, register_random_adapters
from bench.engine_workload import adapter_sets, decode_run
from bench.fp8_quality import DEFAULT_MODEL, SEED_GEMMS, TINY_GEMMS, engine_quality, layer_errors
from lorafleet.kernels.quant.tuning import active_tuning
from lorafleet.worker.config import ModelConfig


def adapter_bytes(config: ModelConfig, rank: int) -> int:
    """One bf16 adapter's A and B over every layer and target, at its rank."""
    return config.num_layers * sum(rank * sum(config.linear_shape(t)) * 2 for t in TARGETS)


def kv_bytes(config: ModelConfig, batch: int, context: float) -> int:
    """The bf16 K and V a decode step reads: every sequence's context, every layer."""
    return int(batch * context * config.num_layers * 2 * config.kv_size * 2)


def kind_rows(args: argparse.Namespace, weights: str, device: str, bw: float) -> list[dict]:
    counts = [d for d in [0] + [int(x) for x in args.adapters.split(",") if x] if d <= args.batch]
    run_args = argparse.Namespace(**vars(args), quantization="fp8" if weights == "fp8" else None)
    t0 = time.perf_counter()
    engine, config, _ = build_engine(run_args, device, max(counts + [1]))
    names = register_random_adapters(engine, config, max(counts + [1]), args.rank)
    weight_bytes = engine.model.weight_bytes()
    read = weight_bytes - config.vocab_size * config.hidden_size * engine.model.weights["embed"].element_size()
    print(f"{weights}: built in {time.perf_counter() - t0:.1f}s, weights {weight_bytes / 2**30:.2f} GiB "
          f"(a step reads {read / 2**30:.2f} GiB of them)", flush=True)
    rows = []
    for plen in [int(x) for x in args.prompt_lens.split(",") if x]:
        decode_run(engine, [()] * args.batch, plen, min(args.new_tokens, 16))  # allocator, JIT, graph capture
        for d in counts:
            sets = adapter_sets(names, d, args.batch)
            decode_run(engine, sets, plen, min(args.new_tokens, 16))
            res = decode_run(engine, sets, plen, args.new_tokens)
            step = read + d * adapter_bytes(config, args.rank) + kv_bytes(config, args.batch, plen + args.new_tokens / 2)
            bound = args.batch * bw / step
            rows.append({"weights": weights, "adapters": d, "batch": args.batch, "prompt": plen,
                         "new_tokens": args.new_tokens, "tokens_per_s": res["tokens_per_s"],
                         "decode_step_ms": res["decode_step_ms"], "byte_bound_tokens_per_s": round(bound, 1),
                         "of_byte_bound": round(res["tokens_per_s"] / bound, 4), "step_bytes": step,
                         "weight_bytes": weight_bytes, "rank": args.rank})
            print(f"{weights:<5} adapters {d:>3} prompt {plen:>4}: {res['tokens_per_s']:>9,.0f} tok/s, step "
                  f"{res['decode_step_ms']} ms, {rows[-1]['of_byte_bound']:.1%} of its byte bound", flush=True)
    del engine
    gc.unfreeze()  # build_engine froze the engine's objects as the worker does: let the collector free them
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(args: argparse.Namespace, copy_bandwidth) -> None:
    """bench/engine.py's main with --weights: the rows, the quality figures, the JSON."""
    device = "cpu" if args.tiny else "cuda"
    gpu = "cpu" if args.tiny else torch.cuda.get_device_name().split()[1].lower()  # "NVIDIA H100 ..." -> h100
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows: list[dict] = []
    for weights in [w for w in args.weights.split(",") if w]:
        if weights not in ("bf16", "fp8"):
            raise SystemExit(f"--weights takes bf16 and fp8, got {weights!r}")
        rows += kind_rows(args, weights, device, bw)
    base = {(r["weights"], r["prompt"]): r["tokens_per_s"] for r in rows if r["adapters"] == 0}
    for r in rows:
        r["vs_bf16_base"] = round(r["tokens_per_s"] / base[("bf16", r["prompt"])], 3) if ("bf16", r["prompt"]) in base else None
    quality: dict = {}
    model = Path(args.quality_model) if args.quality_model else None
    if model is not None and (model / "config.json").is_file():
        quality = engine_quality(model, device, args.quality_prompts, 48, args.quality_new_tokens)
        quality["model"] = str(model)
    else:
        quality["error"] = f"no model at {model} (python -m bench trained_model builds one)"
    quality["layers"] = layer_errors(device, TINY_GEMMS if args.tiny else SEED_GEMMS)
    print(f"quality: {quality}", flush=True)
    result = {"machine": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny smoke run)",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_tb_s": round(bw / 1e12, 3),
              "shape": TINY_SHAPE if args.tiny else SEED_SHAPE, "fp8_tuning_prefill": active_tuning().prefill,
              "summary": {f"fp8_vs_bf16_base_prompt_{p}": round(base[("fp8", p)] / base[("bf16", p)], 3)
                          for (w, p) in base if w == "fp8" and ("bf16", p) in base},
              "rows": rows, "quality": quality}
    print(f"\n{'weights':<8} {'adapters':>8} {'prompt':>6} {'tok/s':>10} {'bound':>10} {'of it':>6} {'vs bf16':>8}")
    for r in rows:
        print(f"{r['weights']:<8} {r['adapters']:>8} {r['prompt']:>6} {r['tokens_per_s']:>10,.0f} "
              f"{r['byte_bound_tokens_per_s']:>10,.0f} {r['of_byte_bound']:>6.1%} {r['vs_bf16_base']!s:>8}")
    print(f"summary: {result['summary']}")
    out = args.out if args.out_given else args.out.parent / f"engine-fp8-{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--weights", default="", help="bf16,fp8: time each weights kind in turn (the rows above) "
                                                  "and write engine-fp8-<gpu>.json instead of the usual run")
    ap.add_argument("--quality-model", default=str(DEFAULT_MODEL), help="with --weights: the trained model of the "
                                                                        "KL check ('' = skip)")
    ap.add_argument("--quality-prompts", type=int, default=16)
    ap.add_argument("--quality-new-tokens", type=int, default=32)

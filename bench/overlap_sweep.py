"""Decode throughput with the LoRA side path placed differently, on one engine (an H200 experiment).

    python -m bench.overlap_sweep [--adapters 0,1,8,64] [--new-tokens 64] [--out FILE]

Each variant picks the BLAS library torch's matmuls use (cuBLAS or cuBLASLt), sets
`lora_linear.OVERLAP_MAX_CHUNKS` (up to how many chunks the side path runs beside the base GEMM on a
second stream rather than after it) and `lora_linear.GEMM_SM_CARVEOUT` (SMs the GEMM beside it leaves
free for the LoRA kernels, with at most and above `lora_linear.FEW_CHUNKS` chunks; only cuBLASLt honours
it) and where the shrink zeroes the delta rather than a memset launch (`lora_linear.ZERO_IN_SHRINK`:
never, always, or above FEW_CHUNKS as the engine does), and, from the seventh session's variants
on, `lora_config.pick_config`'s knobs (KERNEL_KNOBS), then drops the captured decode graphs and
times async decode at batch 64 on the seed shape, as `bench/engine.py` does. Rows: variant, adapters, tok/s,
ratio to the same variant's base-only run (or the first variant's where it has none).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench import lora_bytes_only, read_speed_linear
from bench.engine_build import experiment_engine
from bench.engine_workload import adapter_sets, decode_run
from lorafleet.kernels.lora import config as lora_config
from lorafleet.kernels.lora import launch as triton_lora
from lorafleet.kernels.lora import linear as lora_linear
from lorafleet.kernels.lora import meta as lora_meta
from lorafleet.worker.models.llama import LlamaModel

# The fourteenth session's kernel knobs (its 168-register variant below), the fifteenth session's baseline.
FOURTEENTH_KNOBS = {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4), "EXPAND_ROWS": (512, 2, 168)}

# name -> (BLAS library, overlap max chunks, carveout beside the LoRA (<= 16 chunks, more; or those two
# beside small GEMMs, then beside large ones: lora_linear.carveout_table), where the shrink zeroes the
# delta: "never" (a memset), "always", "many" (above lora_linear.FEW_CHUNKS), and optionally
# lora_linear.GEMM_FIRST with at most, above FEW_CHUNKS chunks (default: the LoRA launched first), then
# lora_linear.DELTA_STORE with at most, above FEW_CHUNKS chunks (default off: every variant before it
# existed; where it is on, the zeroing setting applies only to steps with several adapters per token))
VARIANTS = {
    "cublas (third session)": ("cublas", 16, (0, 0), "never"),
    "cublaslt": ("cublaslt", 16, (0, 0), "never"),
    "cublaslt, carveout 16": ("cublaslt", 16, (16, 16), "never"),
    "cublaslt, carveout 32": ("cublaslt", 16, (32, 32), "never"),
    "cublaslt, beside always": ("cublaslt", 64, (0, 0), "never"),
    "cublaslt, beside always, carveout 32": ("cublaslt", 64, (32, 32), "never"),
    "beside always, carveout 32, memset": ("cublaslt", 1 << 30, (32, 32), "never"),
    "beside always, carveout 32, shrink zeroes": ("cublaslt", 1 << 30, (32, 32), "always"),
    "beside always, carveout 48, shrink zeroes": ("cublaslt", 1 << 30, (48, 48), "always"),
    "now: carveout 32 / 48, shrink zeroes above 16 chunks": ("cublaslt", 1 << 30, (32, 48), "many"),
    "large GEMMs: carveout 16 / 48": ("cublaslt", 1 << 30, (32, 48, 16, 48), "many"),
    "large GEMMs: carveout 8 / 48": ("cublaslt", 1 << 30, (32, 48, 8, 48), "many"),
    "large GEMMs: carveout 0 / 48": ("cublaslt", 1 << 30, (32, 48, 0, 48), "many"),
    "large GEMMs: carveout 16 / 32": ("cublaslt", 1 << 30, (32, 48, 16, 32), "many"),
    "small 16 / 48, large 16 / 48": ("cublaslt", 1 << 30, (16, 48, 16, 48), "many"),
    "small 48 / 48, large 8 / 48": ("cublaslt", 1 << 30, (48, 48, 8, 48), "many"),
    "small 0 / 48, large 0 / 48": ("cublaslt", 1 << 30, (0, 48, 0, 48), "many"),
    "now: carveout 32 / 48, shrink zeroes above 16 chunks, GEMM first above 16 chunks":
        ("cublaslt", 1 << 30, (32, 48), "many", (False, True)),
    "now: carveout 32 / 48, shrink zeroes above 16 chunks, GEMM always first":
        ("cublaslt", 1 << 30, (32, 48), "many", (True, True)),
    "storing expand, carveout 32 / 48, GEMM first above 16 chunks":
        ("cublaslt", 1 << 30, (32, 48), "many", (False, True), (True, True)),
    "storing expand, carveout 32 / 48, GEMM always first":
        ("cublaslt", 1 << 30, (32, 48), "many", (True, True), (True, True)),
    "storing expand, small 32 / 48, large 16 / 48, GEMM first above 16 chunks":
        ("cublaslt", 1 << 30, (32, 48, 16, 48), "many", (False, True), (True, True)),
    "storing expand above 16 chunks, GEMM first above 16 chunks":
        ("cublaslt", 1 << 30, (32, 48), "many", (False, True), (False, True)),
    "storing expand above 16 chunks, GEMM always first":
        ("cublaslt", 1 << 30, (32, 48), "many", (True, True), (False, True)),
    "storing expand, GEMM first, carveout 24 / 48": ("cublaslt", 1 << 30, (24, 48), "many", (True, True), (True, True)),
    "storing expand, GEMM first, carveout 16 / 48": ("cublaslt", 1 << 30, (16, 48), "many", (True, True), (True, True)),
    "storing expand, GEMM first, carveout 48 / 48": ("cublaslt", 1 << 30, (48, 48), "many", (True, True), (True, True)),
    "storing expand, GEMM first, small 32 / 48, large 16 / 48":
        ("cublaslt", 1 << 30, (32, 48, 16, 48), "many", (True, True), (True, True)),
    "storing expand, GEMM first, carveout 32 / 32": ("cublaslt", 1 << 30, (32, 32), "many", (True, True), (True, True)),
    # Beside small GEMMs with many chunks (qkv's LoRA outlasts its GEMM at 64 adapters), more SMs
    # (up to lora_linear.CARVEOUT_MAX_SHARE, 5/8; every carveout above is under the old cap, 3/8):
    "storing expand, GEMM first, many chunks beside small GEMMs: 64":
        ("cublaslt", 1 << 30, (48, 64, 48, 48), "many", (True, True), (True, True)),
    "storing expand, GEMM first, many chunks beside small GEMMs: 80":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True)),
    "storing expand, GEMM first, many chunks: 64":
        ("cublaslt", 1 << 30, (48, 64, 48, 64), "many", (True, True), (True, True)),
    # The seventh session's launch configs (bench/lora_parts.py, alone: shrink with 2 warps 5-8%
    # faster in every case; at 64 chunks the expand of qkv fastest with 512 columns a program and
    # gate_up's with 2048), on the sixth session's defaults (the variant before them):
    "sixth session's defaults": ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True)),
    "shrink 2 warps": ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
                       {"SHRINK_WARPS": (2, 2)}),
    "wide expand from 128 pairs: 512 columns": ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True),
                                                (True, True), {"WIDE_EXPAND": (128, 512)}),
    "wide expand from 128 pairs: 2048 columns": ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True),
                                                 (True, True), {"WIDE_EXPAND": (128, 2048)}),
    "shrink 2 warps, wide expand from 128 pairs: 512":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (2, 2), "WIDE_EXPAND": (128, 512)}),
    "seventh session's defaults: 2 warps above 16 chunks, wide expand from 128 pairs: 512":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512)}),
    # The shrink keeps too few bytes in flight (ncu: 12% occupancy, 50% of DRAM bandwidth at 64
    # adapters): wide K tiles above 16 chunks, each program loading most of its K range at once.
    "seventh session, shrink K tiles of 512, 2 stages above 16 chunks":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_BLOCK_K": (128, 512), "NUM_STAGES": (3, 2)}),
    "seventh session, shrink K tiles of 1024, 2 stages above 16 chunks":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_BLOCK_K": (128, 1024), "NUM_STAGES": (3, 2)}),
    # The eighth session: for one-pair chunks (lora_meta.ONE_PAIR_CHUNKS: above 16 chunks, at most 1.5
    # pairs each on average, none over 2), the shrink a row at a time (multiply-and-sum, no tl.dot; alone: -0.9 to -1.8 µs a
    # pair for gate_up and down at 64 adapters, +0.3 to +0.4 for qkv and o), K tile and warps. The
    # first two runs of these (overlap-sweep-rows*-h200.json) were made while the decode graphs were
    # keyed by chunk class alone, so every step of 17-64 chunks (32 adapters too) took the rows:
    "eighth session, shrink a row at a time: K tile 256, 4 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4)}),
    "eighth session, shrink a row at a time: K tile 512, 4 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (512, 4)}),
    "eighth session, shrink a row at a time: K tile 512, 8 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (512, 8)}),
    "eighth session, shrink a row at a time up to 2 pairs a chunk: K tile 256, 4 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4), "ONE_PAIR_CHUNKS": (2.0, 2)}),
    "eighth session, shrink a row at a time: K tile 256, 2 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 2)}),
    # The thirteenth session: for one-pair chunks the expand a row at a time too (one B tile of this
    # many columns a program, these warps; its tl.dot mode holds 140-145 registers a thread, 3
    # programs an SM), on the eighth session's defaults (the first of these):
    "eighth session's defaults": ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
                                  {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4)}),
    "expand a row at a time: 512 columns, 2 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4), "EXPAND_ROWS": (512, 2)}),
    "expand a row at a time: 256 columns, 1 warp":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4), "EXPAND_ROWS": (256, 1)}),
    "expand a row at a time: 1024 columns, 4 warps":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4), "EXPAND_ROWS": (1024, 4)}),
    # The fourteenth session: the row expand (512 columns, 2 warps) with ptxas' register cap (at rank
    # 16 it holds 204 registers a thread, 4 programs an SM; alone at 64 tokens on 64 adapters a cap of
    # 168 was 3-8% faster, 128 spilled):
    **{f"expand a row at a time, at most {cap} registers":
       ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
        {"SHRINK_WARPS": (4, 2), "WIDE_EXPAND": (128, 512), "SHRINK_ROWS": (256, 4), "EXPAND_ROWS": (512, 2, cap)})
       for cap in (168, 152, 184)},
    # The fifteenth session: the fourteenth's defaults (as the 168-register variant above), then the
    # same with the side path replaced by bench/lora_bytes_only.py's (the adapters' bytes read beside
    # each GEMM, nothing computed: wrong outputs, the time of an ideal kernel pair). The variants that
    # prefetched adapter weights into L2 during the attention (commit 5c45f69) and ran few-pair chunks
    # a row at a time (24688ad) followed these; both lost in the engine and were removed.
    "fourteenth session's defaults":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         dict(FOURTEENTH_KNOBS)),
    "fourteenth session's defaults, bytes only (an ideal LoRA: its reads, no math)":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS,
          "launch_shrink": lora_bytes_only.launch_shrink, "launch_expand": lora_bytes_only.launch_expand}),
    # The bytes-only side path with other carveouts: none (the GEMM on every SM), and 80 SMs beside
    # every GEMM (the most lora_linear.CARVEOUT_MAX_SHARE allows on the H200):
    **{f"fourteenth session's defaults, bytes only, carveout {c}":
       ("cublaslt", 1 << 30, (c, c, c, c), "many", (True, True), (True, True),
        {**FOURTEENTH_KNOBS,
         "launch_shrink": lora_bytes_only.launch_shrink, "launch_expand": lora_bytes_only.launch_expand})
       for c in (0, 80)},
    # The sixteenth session: every decode projection (not the lm_head) replaced by one launch of a
    # streaming read (bench/read_speed_linear.py: the base weight, plus the step's adapters' rows in
    # the same launch, or in a second one; y zeroed, nothing computed): a kernel family that reads
    # each byte once at the speed of a plain read, the best a GEMM with the LoRA fused in could do.
    "read speed: weights and adapters in one launch a projection (no math)":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"linear_deferred": read_speed_linear.linear_deferred, "ONE_LAUNCH": True}),
    "read speed: weights, then adapters in a second launch (no math)":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {"linear_deferred": read_speed_linear.linear_deferred, "ONE_LAUNCH": False}),
    # The eighteenth session's sweep (kernels-sweep-eighteenth-h200.json): at 16 tokens on 1 adapter a
    # K tile of 256 in the tl.dot shrink of steps with at most 16 chunks was 5-7% faster alone in
    # every module; those steps are the engine's 1- and 8-adapter decode. Timed there in the nineteenth
    # session (overlap-sweep-k256*-h200.json: 8 adapters 0.927-0.928 -> 0.930-0.935) and adopted:
    "fourteenth session's defaults, few-chunk shrink K tile 256":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS, "SHRINK_BLOCK_K": (256, 128)}),
    # The twentieth session: the tl.dot expand's next tile loaded before this one is written
    # (`lora_config.EXPAND_AHEAD`), everywhere; measured at commit f1b180c as that commit's
    # "expand loads ahead 2", whose programs of one tile took the lookahead too, which none of the
    # engine's 8-adapter decode launches has (overlap-sweep-ahead-h200.json: 8 adapters 0.933 ->
    # 0.932; the decode side path's storing expand loads only B ahead), then only with few chunks
    # (the default since). A variant
    # that also issued the second tile's loads before the wait for the shrink (f0797df,
    # overlap-sweep-ahead-early-h200.json) lost and was removed with its knob.
    "nineteenth session's defaults, expand loads ahead":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS, "SHRINK_BLOCK_K": (256, 128), "EXPAND_AHEAD": (True, True)}),
    "twentieth session's defaults (expand loads ahead with few chunks)":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS, "SHRINK_BLOCK_K": (256, 128), "EXPAND_AHEAD": (True, False)}),
    # The twenty-first session: the expand's sum over the shrink's K splits unrolled, every split's
    # loads in one round (`lora_config.EXPAND_SPLIT_SUM`), on the twentieth's defaults.
    "twentieth session's defaults, splits summed unrolled":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS, "SHRINK_BLOCK_K": (256, 128), "EXPAND_AHEAD": (True, False),
          "EXPAND_SPLIT_SUM": "unroll"}),
    # The row shrink (64 adapters) summing across K once, after its last K tile, plain, pipelined in 2
    # or 3 stages or unrolled twice, against the sum after each tile (form 0), on the same defaults
    # (commit b0d4687's `lora_config.SHRINK_ROWS_SUM`, removed after it: overlap-sweep-rows-sum-h200.json,
    # 64 adapters 0.781 / 0.780 with form 0, 0.742-0.783 with the others; docs/benchmarks-history.md,
    # twenty-first session). Kept as the row of form 0, the twenty-first session's defaults (the same
    # settings as the variant before it; the name is the one that run's rows carry):
    "twenty-first session's defaults, row shrink's K loop 0":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS, "SHRINK_BLOCK_K": (256, 128), "EXPAND_AHEAD": (True, False),
          "EXPAND_SPLIT_SUM": "unroll"}),
    # A chunk's slot, start and end loaded in one round (`lora_config.CHUNK_META_ROUND`; alone qkv 0.96x
    # and gate/up 0.98x at 64 tokens on 64 adapters, meta-round*-h200.json), on the same defaults:
    "twenty-first session's defaults, chunk meta in one round":
        ("cublaslt", 1 << 30, (48, 80, 48, 48), "many", (True, True), (True, True),
         {**FOURTEENTH_KNOBS, "SHRINK_BLOCK_K": (256, 128), "EXPAND_AHEAD": (True, False),
          "EXPAND_SPLIT_SUM": "unroll", "CHUNK_META_ROUND": True}),
}
# The lora_config (triton_lora, lora_meta) knobs a variant's seventh element may set; every other variant runs
# the sixth session's values, which all variants before them ran with.
KERNEL_KNOBS = {"SHRINK_WARPS": (4, 4), "WIDE_EXPAND": (256, 512), "SHRINK_BLOCK_K": (128, 128), "NUM_STAGES": (3, 3),
                "SHRINK_ROWS": (), "ONE_PAIR_CHUNKS": (1.5, 2), "EXPAND_ROWS": (), "EXPAND_AHEAD": (False, False),
                "EXPAND_SPLIT_SUM": "loop", "CHUNK_META_ROUND": False,
                "launch_shrink": triton_lora.launch_shrink,
                "launch_expand": triton_lora.launch_expand,
                "linear_deferred": LlamaModel._linear_deferred, "ONE_LAUNCH": True}
KNOB_HOMES = {"linear_deferred": (LlamaModel, "_linear_deferred"), "ONE_LAUNCH": (read_speed_linear, "ONE_LAUNCH")}


def knob_home(knob: str) -> tuple[object, str]:
    """Where a variant's knob lives: KNOB_HOMES, else the first of lora_config, triton_lora, lora_meta that has it."""
    if knob in KNOB_HOMES:
        return KNOB_HOMES[knob]
    home = next((m for m in (lora_config, triton_lora, lora_meta) if hasattr(m, knob)), None)
    if home is None:
        raise KeyError(f"knob {knob!r} is in none of lora_config, triton_lora, lora_meta")
    return home, knob


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", default="0,1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variants", default="", help="comma-separated indices into VARIANTS, in order ('' = all)")
    ap.add_argument("--repeats", type=int, default=1, help="run the variant list this many times (noise)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/overlap-sweep-h200.json"))
    args = ap.parse_args()
    counts = [int(x) for x in args.adapters.split(",") if x]
    variants = list(VARIANTS)
    picked = [variants[int(i)] for i in args.variants.split(",") if i] or variants
    engine, names = experiment_engine(args.batch, max(counts + [1]))
    graphs = engine.runner.graphs
    rows = []
    few_chunks = lora_linear.FEW_CHUNKS
    for rep, name in ((rep, name) for rep in range(args.repeats) for name in picked):
        blas, max_chunks, beside_carveout, zero, *rest = VARIANTS[name]
        lora_linear.OVERLAP_MAX_CHUNKS, lora_linear.GEMM_SM_CARVEOUT = max_chunks, lora_linear.carveout_table(beside_carveout)
        lora_linear.ZERO_IN_SHRINK = zero != "never"
        lora_linear.GEMM_FIRST = rest[0] if rest else (False, False)
        lora_linear.DELTA_STORE = rest[1] if len(rest) > 1 else (False, False)
        for knob, value in {**KERNEL_KNOBS, **(rest[2] if len(rest) > 2 else {})}.items():
            setattr(*knob_home(knob), value)
        lora_linear.FEW_CHUNKS = 0 if zero == "always" else few_chunks
        torch.backends.cuda.preferred_blas_library(blas)
        graphs._graphs.clear()  # recapture under this variant's settings
        torch.cuda.synchronize()
        for d in counts:
            sets = adapter_sets(names, d, args.batch)
            decode_run(engine, sets, args.prompt_len, 8)  # captures
            res = decode_run(engine, sets, args.prompt_len, args.new_tokens)
            rows.append({"variant": name, "pass": rep, "blas": blas, "overlap_max_chunks": max_chunks,
                         "beside_carveout": list(beside_carveout), "zero_in_shrink": zero, "adapters": d, **res})
            print(f"{name:<28} {d:>3} adapters: {res['tokens_per_s']:>9,.0f} tok/s  step {res['decode_step_ms']} ms",
                  flush=True)
    first_base = next((r["tokens_per_s"] for r in rows if r["adapters"] == 0), None)
    for r in rows:
        own = next((q["tokens_per_s"] for q in rows if q["variant"] == r["variant"] and q["pass"] == r["pass"] and q["adapters"] == 0), None)
        base = own or first_base
        r["vs_base"] = round(r["tokens_per_s"] / base, 3) if base else None
    print(f"\n{'variant':<38} {'pass':>4} {'adapters':>8} {'tok/s':>9} {'vs base':>8}")
    for r in rows:
        print(f"{r['variant']:<38} {r['pass']:>4} {r['adapters']:>8} {r['tokens_per_s']:>9,.0f} {r['vs_base']!s:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
                                    "new_tokens": args.new_tokens, "batch": args.batch, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Could one launch a projection (GEMM + LoRA, `bench/gemm_lora.py`) reach 0.80x at 64 adapters? (H200)

    python -m bench.fused_gemm_bound [--layers 3] [--out bench/results/fused-gemm-bound-h200.json]

One decode layer of the seed shape at batch 64 (qkv, o, gate_up, down; bf16), 64 distinct rank-16
adapters on all 7 projections (one a token), each variant timed as the projections of `--layers`
copies of the layer captured back to back in one CUDA graph (a layer's weights are ~9x the L2, so
every copy is read from DRAM; `do_bench` median; µs a layer):

  cublas            the base GEMMs (`F.linear`, cuBLASLt as the engine picks it)
  cublas + side     the engine's path: each GEMM with the LoRA side path beside it
                    (`linear_lora_deferred`, its carveouts)
  read W / read W+A+B / read W, then A+B
                    a streaming read of the weights alone, of weights and adapters in one launch a
                    projection, and in two: what moving the bytes costs
  triton gemm       `gemm_lora` without the LoRA (how close a Triton GEMM gets to cuBLASLt)
  fused split / fused one launch
                    `gemm_lora` with the LoRA, two launches (shrink, GEMM + expand) or one (grid
                    barrier); each config checked against the fp32 reference first

Per projection every config is timed alone and the best kept; the layer rows run the best configs.
"projected" turns a layer's time into the engine's 64-adapter ratio: the fifteenth session's
base-only step (5.03 ms) plus 32 layers of (variant − cublas). The `cublas + side` row's projection
is the check on the method: the engine measured 0.775 there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from bench.gemm_lora import FusedLora, GemmConfig, gemm_lora, gemm_lora_reference, new_workspace
from bench.kernels import measure_copy_bandwidth, time_graph
from bench.read_bandwidth import triton_read
from lorafleet.kernels.lora_ops import build_lora_meta, linear_lora_deferred, new_lora_b
from lorafleet.worker.cuda_graphs import chunk_class

T, SLOTS, RANK = 64, 64, 16
HIDDEN, KV, MLP = 4096, 1024, 14336
PROJ = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)), "gate_up": (HIDDEN, (MLP, MLP)),
        "down": (MLP, (HIDDEN,))}
BASE_STEP_MS, LAYERS = 5.03, 32  # fifteenth session's base-only async step, the model's layers
CONFIGS = {  # (block_n, block_k, split, stages, warps); shrink pieces so (piece, token, slice) units ≥ ~4 an SM
    "qkv": ([(64, 128, 4, 4, 4), (32, 128, 2, 4, 4), (128, 128, 8, 3, 4), (64, 256, 4, 3, 4)], 4),
    "o": ([(64, 128, 4, 4, 4), (64, 128, 8, 4, 4), (32, 128, 4, 4, 4), (64, 256, 4, 3, 4)], 8),
    "gate_up": ([(64, 128, 2, 4, 4), (128, 128, 4, 3, 8), (64, 128, 1, 4, 4), (64, 256, 2, 3, 4)], 4),
    "down": ([(64, 128, 8, 4, 4), (64, 128, 16, 4, 4), (32, 128, 8, 4, 4), (64, 256, 8, 3, 4)], 8),
}


class Proj:
    """One projection of one layer copy: W, A and B in one flat buffer (so a read of it moves
    exactly their bytes), the engine's own slot pools beside, inputs and outputs."""

    def __init__(self, name: str, g: torch.Generator):
        k, slices = PROJ[name]
        n, j = sum(slices), len(slices)
        self.name, self.k, self.n, self.slices = name, k, n, slices
        sizes = [n * k, SLOTS * j * RANK * k, SLOTS * RANK * n]
        self.flat = torch.empty(sum(sizes), device="cuda", dtype=torch.bfloat16)
        self.flat.normal_(generator=g).mul_(k**-0.5)
        w, a, b = torch.split(self.flat, sizes)
        self.w, self.w_flat, self.ad_flat = w.view(n, k), w, self.flat[sizes[0]:]
        slot = torch.arange(T, device="cuda", dtype=torch.int32) % SLOTS
        scale = torch.rand(T, device="cuda", generator=g) + 0.5
        self.lora = FusedLora(a.view(SLOTS, j, RANK, k), b.view(SLOTS, RANK, n), slices, slot, scale,
                              torch.full((SLOTS,), RANK, device="cuda", dtype=torch.int32))
        self.x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16, generator=g)
        self.y = torch.empty(T, n, device="cuda", dtype=torch.bfloat16)
        self.pool_a = [torch.randn(SLOTS, RANK, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
                       for _ in slices]
        self.pool_b = [new_lora_b(SLOTS, o, RANK, device="cuda", dtype=torch.bfloat16) for o in slices]
        for b_ in self.pool_b:
            b_.normal_(generator=g)
        meta = build_lora_meta(slot.cpu().view(T, 1), scale.cpu().view(T, 1), SLOTS, "cuda")
        meta.rank_bound = RANK
        meta.launch_chunks = chunk_class(meta.num_chunks, meta.max_chunks)
        self.meta = meta
        self.ranks = [[RANK] * SLOTS for _ in slices]
        self.ranks_dev = torch.tensor(self.ranks, dtype=torch.int32, device="cuda")
        self.read_out = torch.empty(triton.cdiv(self.flat.numel(), 4096 * 4), device="cuda")

    @property
    def w_bytes(self) -> int:
        return self.w_flat.numel() * 2

    @property
    def ad_bytes(self) -> int:
        return self.ad_flat.numel() * 2


def cfg_of(spec: tuple[int, ...], pieces: int) -> GemmConfig:
    bn, bk, split, stages, warps = spec
    return GemmConfig(block_n=bn, block_k=bk, split=split, stages=stages, warps=warps, pieces=pieces,
                      block_ks=256)


def calls_for(variant: str, p: Proj, side: torch.cuda.Stream, cfg: GemmConfig | None):
    if variant == "cublas":
        return lambda: F.linear(p.x, p.w)
    if variant == "cublas + side":
        return lambda: linear_lora_deferred(lambda: F.linear(p.x, p.w), p.x, p.pool_a, p.pool_b, p.ranks,
                                            p.ranks_dev, p.meta, backend="triton", side_stream=side)
    if variant == "read W":
        return lambda: triton_read(p.w_flat, p.read_out, 4096, 4)
    if variant == "read W+A+B":
        return lambda: triton_read(p.flat, p.read_out, 4096, 4)
    if variant == "read W, then A+B":
        return lambda: (triton_read(p.w_flat, p.read_out, 4096, 4), triton_read(p.ad_flat, p.read_out, 4096, 4))
    lora = None if variant == "triton gemm" else p.lora
    phases = "split" if variant == "fused split" else "fused"
    ws = new_workspace(T, p.n, lora, cfg, "cuda")
    return lambda: gemm_lora(p.x, p.w, p.y, lora, ws, cfg, phases=phases)


def check(p: Proj, variant: str, cfg: GemmConfig) -> float:
    lora = None if variant == "triton gemm" else p.lora
    ws = new_workspace(T, p.n, lora, cfg, "cuda")
    errs = []
    for _ in range(2):  # the second launch reuses the workspace as a graph replay would
        p.y.zero_()
        gemm_lora(p.x, p.w, p.y, lora, ws, cfg, phases="split" if variant == "fused split" else "fused")
        ref = gemm_lora_reference(p.x, p.w, lora)
        errs.append(float((p.y.float() - ref).norm() / ref.norm()))
    torch.cuda.synchronize()
    return max(errs)


TRITON_VARIANTS = ("triton gemm", "fused split", "fused one launch")
FIXED_VARIANTS = ("cublas", "cublas + side", "read W", "read W+A+B", "read W, then A+B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/fused-gemm-bound-h200.json"))
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    layers = [{name: Proj(name, g) for name in PROJ} for _ in range(args.layers)]
    rows, best = [], {}
    for name, (specs, pieces) in CONFIGS.items():
        copies = [layer[name] for layer in layers]
        p0 = copies[0]
        for variant in FIXED_VARIANTS:
            us = time_graph([calls_for(variant, p, side, None) for p in copies])
            rows.append({"proj": name, "variant": variant, "config": None, "us": round(us, 2)})
        for variant in TRITON_VARIANTS:
            for spec in specs:
                cfg = cfg_of(spec, pieces)
                err = check(p0, variant, cfg)
                us = time_graph([calls_for(variant, p, side, cfg) for p in copies])
                rows.append({"proj": name, "variant": variant, "config": list(spec), "us": round(us, 2),
                             "rel_err": float(f"{err:.2e}")})
                if err > 1e-2:
                    raise SystemExit(f"{name} {variant} {spec}: rel err {err:.2e}")
                if us < best.get((name, variant), (1e9, None))[0]:
                    best[(name, variant)] = (us, cfg)
        for r in rows:
            if r["proj"] == name:
                nbytes = p0.w_bytes + (p0.ad_bytes if r["variant"] not in ("cublas", "read W", "triton gemm") else 0)
                r["tb_s"] = round(nbytes / (r["us"] * 1e-6) / 1e12, 3)
                print(f"{name:8s} {r['variant']:18s} {str(r['config'] or ''):22s} {r['us']:8.2f} µs "
                      f"{r['tb_s']:6.3f} TB/s {r.get('rel_err', '')}", flush=True)
    # whole layers with each variant's best configs
    layer_rows = []
    for variant in FIXED_VARIANTS + TRITON_VARIANTS:
        calls = [calls_for(variant, layer[name], side, best.get((name, variant), (0, None))[1])
                 for layer in layers for name in PROJ]
        us = time_graph(calls) * len(PROJ)
        layer_rows.append({"variant": variant, "us_per_layer": round(us, 2)})
    base = layer_rows[0]["us_per_layer"]
    w_bytes = sum(layers[0][n].w_bytes for n in PROJ)
    all_bytes = w_bytes + sum(layers[0][n].ad_bytes for n in PROJ)
    print(f"\n{'layer':22s} {'µs':>8s} {'TB/s':>7s} {'projected':>9s}")
    for r in layer_rows:
        nbytes = w_bytes if r["variant"] in ("cublas", "read W", "triton gemm") else all_bytes
        r["tb_s"] = round(nbytes / (r["us_per_layer"] * 1e-6) / 1e12, 3)
        r["projected_ratio"] = round(BASE_STEP_MS / (BASE_STEP_MS + LAYERS * (r["us_per_layer"] - base) / 1e3), 3)
        print(f"{r['variant']:22s} {r['us_per_layer']:8.2f} {r['tb_s']:7.3f} {r['projected_ratio']:9.3f}")
    best_cfg = {f"{n} {v}": [c.block_n, c.block_k, c.split, c.stages, c.warps] for (n, v), (_, c) in best.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"), "copy_tb_s": round(bw / 1e12, 3), "layers": args.layers,
        "tokens": T, "adapters": SLOTS, "rank": RANK, "w_bytes_per_layer": w_bytes, "all_bytes_per_layer": all_bytes,
        "base_step_ms": BASE_STEP_MS, "rows": rows, "layer_rows": layer_rows, "best_configs": best_cfg,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()

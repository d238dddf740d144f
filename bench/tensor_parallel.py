"""Tensor-parallel decode: tokens/s of the sharded model against the per-GPU byte bound plus the all-reduce time.

Every rank builds its shard of a random-weight model (the Llama 3 70B shape by default, bf16 on CUDA)
through the engine's own sharded loading (`worker/models/sharding.py`), its shard of `--adapters`
random rank-`--rank` adapters, and a KV cache for `--batch` sequences of `--context` tokens, then times
decode steps of the model (the forward and its collectives; sampling is rank 0's and not timed). The
step's communication is timed alone too: one all-reduce of `[batch, hidden]` per row-parallel layer
(2 per layer) and one for the embedding, plus the logits gather.

    bound step = (shard weight bytes but the embedding's + its KV bytes read + its LoRA bytes read) / HBM bandwidth
                 + measured all-reduce time per step
    bound_tokens_per_s = batch / bound step;   ratio = tokens_per_s / bound_tokens_per_s

Run (one host, N GPUs):  python -m bench tensor_parallel --tp 4 --adapters 0,8,64 --out bench/results/tp-<gpu>.json
CPU smoke run (gloo):    python -m bench tensor_parallel --tp 2 --tiny --device cpu --steps 3

`--one-gpu-shard` (one GPU, one process): rank `--shard-rank`'s shard of the model at `--tp` N, alone,
its collectives replaced by local copies of the same sizes (`LocalCopies`: each all-reduce one copy of
its tensor, the logits gather N - 1 copies of the rank's part), which are timed alone as the
`allreduce_ms_per_step` column. So the figures are one rank's compute and HBM traffic, without NCCL:
the real all-reduce time over NVLink is not in them (add it to both the step and the bound). With
`--graphs` each adapter count is also timed replaying one CUDA graph of the whole step: what the
engine replays under TP, where every rank captures and replays its own decode graphs
(`RankGraphs`, worker/engine/rank_graphs.py). Without `--one-gpu-shard` every rank captures its step
at once, the NCCL collectives inside the graph; that has not been run yet (no multi-GPU machine).

    python -m bench tensor_parallel --one-gpu-shard --tp 4 --adapters 0,8,64 --graphs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.engine_build import SEED_SHAPE, TINY_SHAPE, random_adapter, random_weights
from lorafleet.kernels.lora.meta import build_lora_meta
from lorafleet.worker.config import ModelConfig
from lorafleet.worker.engine.device_setup import resolve_lora_backend
from lorafleet.worker.engine.parallel import free_port, init_group
from lorafleet.worker.layers.attention import AttentionMetadata, resolve_attention_backend
from lorafleet.worker.lora.slots import LoraSlots
from lorafleet.worker.models.registry import model_class
from lorafleet.worker.models.sharding import Shard, shard_checkpoint, shard_config, shard_lora
from lorafleet.worker.models.tensor_parallel import build_sharded

DISTINCT_SHARD_ADAPTERS = 8  # --one-gpu-shard: slot s holds adapter s % 8 (its own copy: the bytes read are the same)


class LocalCopies:
    """One rank's collectives on one device, for `--one-gpu-shard`: an all-reduce copies its tensor
    into a buffer of the same size (and leaves it as it is); the logits gather returns the rank's part
    and N - 1 copies of it. Not NCCL: a stand-in of the same sizes, so the step keeps its shape."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        torch.empty_like(t).copy_(t)

    def gather(self, t: torch.Tensor, shard: Shard) -> list[torch.Tensor] | None:
        return [t] + [t.clone() for _ in range(shard.world - 1)]

LLAMA3_70B = dict(SEED_SHAPE, vocab_size=128_256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0}  # SXM peak; --hbm-gbps overrides


def _config(tiny: bool, layers: int | None) -> ModelConfig:
    import tempfile

    folder = Path(tempfile.mkdtemp())
    shape = dict(TINY_SHAPE if tiny else LLAMA3_70B)
    if layers:
        shape["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(shape))
    return ModelConfig.from_folder(folder)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_inputs(c: ModelConfig, batch: int, context: int, block_size: int, device: torch.device):
    blocks_per_seq = -(-context // block_size)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    pos = context - 1
    slots = tables[:, pos // block_size].to(torch.int64) * block_size + pos % block_size
    attn = AttentionMetadata(query_lens=[1] * batch, context_lens=[context] * batch,
                             query_start=list(range(batch + 1)), slot_mapping=slots.to(device),
                             block_tables=tables.to(device), context_lens_t=torch.full((batch,), context,
                                                                                        dtype=torch.int32, device=device),
                             all_decode=True)
    ids = torch.randint(0, c.vocab_size, (batch,), generator=torch.Generator().manual_seed(1)).to(device)
    return ids, torch.full((batch,), pos, dtype=torch.int64, device=device), attn, batch * blocks_per_seq


def _rank(rank: int, args: argparse.Namespace, init: str, out: str | None) -> None:
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    group = init_group(rank, args.tp, init, device)
    full = _config(args.tiny, args.layers)
    shard = group.shard
    model, slots, dtype = _build(full, shard, device, args)
    results = _measure(model, slots, full, shard, device, dtype, args)
    if rank == 0:
        _report(results, full, device, args, out, "nccl" if device.type == "cuda" else "gloo")
    dist.destroy_process_group()


def _one_gpu_shard(args: argparse.Namespace) -> None:
    """Rank `--shard-rank`'s shard alone on one device, its collectives replaced by `LocalCopies`."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    full = _config(args.tiny, args.layers)
    model, slots, dtype = _build(full, Shard(args.shard_rank, args.tp), device, args)
    model.comm = LocalCopies()  # type: ignore[attr-defined]
    results = _measure(model, slots, full, Shard(args.shard_rank, args.tp), device, dtype, args)
    _report(results, full, device, args, args.out, f"local copies of the same sizes, not NCCL (shard {args.shard_rank} "
            f"of {args.tp} alone on one device: add the real all-reduce time to both the step and the bound)")


def _build(full: ModelConfig, shard: Shard, device: torch.device, args: argparse.Namespace):
    """The shard's model (random weights cut by the engine's own loading) and its adapter slots."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_sharded(model_class(full), full, shard, device, dtype, args.context + 1)
    model.load_weights(shard_checkpoint(random_weights(full, device.type), full, shard))
    model.lora_backend = resolve_lora_backend("auto", device)
    model.attention_backend = resolve_attention_backend("auto", device)
    c = shard_config(full, shard.world)
    max_adapters = max(args.adapters)
    slots = LoraSlots(c, max(max_adapters, 1), args.rank, device, dtype)
    if args.one_gpu_shard:  # made at the shard's shapes (the same bytes as a full adapter's slice), a few reused
        distinct = [random_adapter(c, args.rank, seed=s) for s in range(min(max_adapters, DISTINCT_SHARD_ADAPTERS))]
        for w in distinct:
            w.packed = slots.pack(w)
        for s in range(max_adapters):
            slots.fill(s, distinct[s % len(distinct)])
    else:
        for s in range(max_adapters):
            slots.fill(s, shard_lora(random_adapter(full, args.rank, seed=s), full, shard))
    slots.wait(list(range(max_adapters)))
    model.lora = slots
    return model, slots, dtype


def _measure(model, slots: LoraSlots, full: ModelConfig, shard: Shard, device: torch.device, dtype: torch.dtype,
             args: argparse.Namespace) -> list[dict]:
    """Decode steps per adapter count (eager; with `--graphs` also one replayed CUDA graph a step)."""
    c = shard_config(full, shard.world)
    ids, positions, attn, num_blocks = _decode_inputs(full, args.batch, args.context, args.block_size, device)
    shape = (num_blocks + 1, args.block_size, c.num_kv_heads, c.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
          for _ in range(c.num_layers)]
    rows = torch.arange(args.batch, device=device)
    hbm = args.hbm_gbps or next((v for k, v in HBM_GBPS.items() if device.type == "cuda"
                                 and k in torch.cuda.get_device_name(device)), 0.0)
    comm = model.comm
    w = model.weights  # a decode step reads every weight but the embedding (only its batch's rows)
    weights_read = model.weight_bytes() - (0 if w["embed"].data_ptr() == w["lm_head"].data_ptr()
                                           else w["embed"].numel() * w["embed"].element_size())
    together = dist.barrier if dist.is_initialized() else (lambda: None)
    results = []
    with torch.inference_mode():
        x = torch.zeros(args.batch, full.hidden_size, dtype=dtype, device=device)
        part = torch.zeros(args.batch, model.weights["lm_head"].shape[0], dtype=dtype, device=device)
        for n in args.adapters:
            meta = None
            if n:
                token_slots = (torch.arange(args.batch, dtype=torch.int32) % n).view(-1, 1)
                meta = build_lora_meta(token_slots, torch.ones(args.batch, 1), slots.num_slots, device)
                meta.launch_chunks = meta.num_chunks
                meta.rank_bound = args.rank
            for _ in range(2):  # warm-up: compiles, allocator
                model.forward(ids, positions, attn, kv, meta, rows)
            _sync(device)
            together()
            step_s = _timed(lambda meta=meta: model.forward(ids, positions, attn, kv, meta, rows), args.steps, device)
            together()

            def collectives() -> None:
                for _ in range(2 * c.num_layers + 1):  # o and down per layer, the embedding
                    comm.all_reduce(x)
                comm.gather(part, shard)

            allreduce_s = _timed(collectives, args.steps, device)
            kv_bytes = 2 * c.num_layers * args.batch * args.context * c.num_kv_heads * c.head_dim * x.element_size()
            lora_bytes = sum(t[:, :n].numel() * t.element_size() for pair in slots._storage for t in pair) if n else 0
            byte_s = (weights_read + kv_bytes + lora_bytes) / (hbm * 1e9) if hbm else float("nan")
            bound = args.batch / (byte_s + allreduce_s)
            row = {"tp": shard.world, "adapters": n, "batch": args.batch, "context": args.context,
                   "tokens_per_s": round(args.batch / step_s, 1), "bound_tokens_per_s": round(bound, 1),
                   "ratio": round(args.batch / step_s / bound, 3),
                   "allreduce_ms_per_step": round(allreduce_s * 1e3, 3), "step_ms": round(step_s * 1e3, 3),
                   "byte_bound_ms": round(byte_s * 1e3, 3)}
            if args.graphs and device.type == "cuda":
                row.update(_graph_row(model, ids, positions, attn, kv, meta, rows, args, bound))
            results.append(row)
    return results


def _timed(fn, steps: int, device: torch.device) -> float:
    """Seconds per call of `fn` over `steps` calls (the device synchronized around them)."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _graph_row(model, ids, positions, attn, kv, meta, rows, args: argparse.Namespace, bound: float) -> dict:
    """The step captured as one CUDA graph and replayed (fixed shapes: the same step every time)."""
    try:
        fixed = dataclasses.replace(attn, fixed_shapes=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture
            model.forward(ids, positions, fixed, kv, meta, rows, graph=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward(ids, positions, fixed, kv, meta, rows, graph=True)
        graph.replay()
        step_s = _timed(graph.replay, args.steps, ids.device)
    except Exception as e:  # noqa: BLE001 - reported in the row; the eager figures stand
        return {"graph_error": f"{type(e).__name__}: {e}"[:300]}
    return {"graph_tokens_per_s": round(args.batch / step_s, 1), "graph_step_ms": round(step_s * 1e3, 3),
            "graph_ratio": round(args.batch / step_s / bound, 3)}


def _report(results: list[dict], full: ModelConfig, device: torch.device, args: argparse.Namespace,
            out: str | None, collectives: str) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {'tiny' if args.tiny else 'llama3-70b'} shape, {full.num_layers} layers, TP {args.tp}, "
          f"LoRA rank {args.rank}; collectives: {collectives}")
    cols = ["adapters", "tokens_per_s", "bound_tokens_per_s", "ratio", "step_ms", "byte_bound_ms",
            "allreduce_ms_per_step", "graph_tokens_per_s", "graph_ratio"]
    print("  ".join(f"{c:>20}" for c in cols))
    for row in results:
        print("  ".join(f"{row.get(c, '-')!s:>20}" for c in cols))
        if "graph_error" in row:
            print(f"  graph capture failed: {row['graph_error']}")
    if out:
        Path(out).write_text(json.dumps({"device": name, "shape": "tiny" if args.tiny else "llama3-70b",
                                         "layers": full.num_layers, "rank": args.rank, "collectives": collectives,
                                         "one_gpu_shard": args.one_gpu_shard, "rows": results}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="TINY_SHAPE instead of Llama 3 70B (CPU smoke runs)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a shard that fits one GPU)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")], default=[0, 8, 64])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hbm-gbps", type=float, default=0.0, help="per-GPU memory bandwidth (default: by GPU name)")
    p.add_argument("--out", default=None)
    p.add_argument("--one-gpu-shard", action="store_true",
                   help="one rank's shard alone on one device, collectives replaced by local copies (module docstring)")
    p.add_argument("--shard-rank", type=int, default=0, help="--one-gpu-shard: which rank's shard (0 gathers the logits)")
    p.add_argument("--graphs", action="store_true", help="also time each step replayed as one CUDA graph (CUDA only)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.one_gpu_shard:
        _one_gpu_shard(args)
        return
    mp.spawn(_rank, args=(args, f"tcp://127.0.0.1:{free_port()}", args.out), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()

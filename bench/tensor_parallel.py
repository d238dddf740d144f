"""Tensor-parallel decode: tokens/s of the sharded model against the per-GPU byte bound plus the all-reduce time.

Every rank builds its shard of a random-weight model (the Llama 3 70B shape by default, bf16 on CUDA)
through the engine's own sharded loading (`worker/models/sharding.py`), its shard of `--adapters`
random rank-`--rank` adapters, and a KV cache for `--batch` sequences of `--context` tokens, then times
decode steps of the model (the forward and its collectives; sampling is rank 0's and not timed). The
step's communication is timed alone too: one all-reduce of `[batch, hidden]` per row-parallel layer
(2 per layer) and one for the embedding, plus the logits gather.

    bound step = (shard weight bytes + its KV bytes read + its LoRA bytes read) / HBM bandwidth
                 + measured all-reduce time per step
    bound_tokens_per_s = batch / bound step;   ratio = tokens_per_s / bound_tokens_per_s

Run (one host, N GPUs):  python -m bench tensor_parallel --tp 4 --adapters 0,8,64 --out bench/results/tp-<gpu>.json
CPU smoke run (gloo):    python -m bench tensor_parallel --tp 2 --tiny --device cpu --steps 3
"""

from __future__ import annotations

import argparse
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
from lorafleet.worker.models.sharding import shard_checkpoint, shard_config, shard_lora
from lorafleet.worker.models.tensor_parallel import build_sharded

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
    shard = group.shard
    full = _config(args.tiny, args.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_sharded(model_class(full), full, shard, device, dtype, args.context + 1)
    model.load_weights(shard_checkpoint(random_weights(full, device.type), full, shard))
    model.lora_backend = resolve_lora_backend("auto", device)
    model.attention_backend = resolve_attention_backend("auto", device)
    c = shard_config(full, args.tp)
    max_adapters = max(args.adapters)
    slots = LoraSlots(c, max(max_adapters, 1), args.rank, device, dtype)
    for s in range(max_adapters):
        slots.fill(s, shard_lora(random_adapter(full, args.rank, seed=s), full, shard))
    slots.wait(list(range(max_adapters)))
    model.lora = slots
    ids, positions, attn, num_blocks = _decode_inputs(full, args.batch, args.context, args.block_size, device)
    shape = (num_blocks + 1, args.block_size, c.num_kv_heads, c.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
          for _ in range(c.num_layers)]
    rows = torch.arange(args.batch, device=device)
    hbm = args.hbm_gbps or next((v for k, v in HBM_GBPS.items() if device.type == "cuda"
                                 and k in torch.cuda.get_device_name(device)), 0.0)
    results = []
    with torch.inference_mode():
        x = torch.zeros(args.batch, full.hidden_size, dtype=dtype, device=device)
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
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                model.forward(ids, positions, attn, kv, meta, rows)
            _sync(device)
            step_s = (time.perf_counter() - t0) / args.steps
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                for _ in range(2 * c.num_layers + 1):
                    dist.all_reduce(x)
            _sync(device)
            allreduce_s = (time.perf_counter() - t0) / args.steps
            kv_bytes = 2 * c.num_layers * args.batch * args.context * c.num_kv_heads * c.head_dim * x.element_size()
            lora_bytes = sum(t[:, :n].numel() * t.element_size() for pair in slots._storage for t in pair) if n else 0
            byte_s = (model.weight_bytes() + kv_bytes + lora_bytes) / (hbm * 1e9) if hbm else float("nan")
            bound = args.batch / (byte_s + allreduce_s)
            results.append({"tp": args.tp, "adapters": n, "batch": args.batch, "context": args.context,
                            "tokens_per_s": round(args.batch / step_s, 1), "bound_tokens_per_s": round(bound, 1),
                            "ratio": round(args.batch / step_s / bound, 3),
                            "allreduce_ms_per_step": round(allreduce_s * 1e3, 3),
                            "step_ms": round(step_s * 1e3, 3)})
    if rank == 0:
        for row in results:
            print(json.dumps(row), flush=True)
        if out:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            Path(out).write_text(json.dumps({"device": name, "shape": "tiny" if args.tiny else "llama3-70b",
                                             "layers": full.num_layers,
                                             "rank": args.rank, "rows": results}, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> None:
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
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(args, f"tcp://127.0.0.1:{free_port()}", args.out), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()

"""Kernels a decode step launches per decoder layer, per family and elementwise backend (issue 50).

    python -m bench.layer_kernels [--archs llama,gemma2] [--backends torch,triton] [--batch 4]

Each family's model (worker/models/) is built twice on a tiny shape of its own, with 1 and with 2
layers and random fp32 weights, and runs a decode step of `--batch` sequences (base model, no
adapters) under a counter of launches: every aten op that runs a kernel (views, reshapes and
`empty` allocations launch none) and every Triton kernel launch (the aten ops a Triton launch runs
inside the interpreter are its own, not counted). Per layer = the 2-layer step's count less the
1-layer one's; per step = the rest (embedding, final norm, lm_head, soft-capping). The count is
the same on a GPU, where a CUDA graph replays these launches (~2-4 µs each even there): the Triton
backend is what the engine runs on CUDA. Without CUDA the Triton kernels run in the interpreter
(TRITON_INTERPRET=1 is set here when CUDA is absent). Prints a table; `--json F` writes the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before their import

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_models import SHAPES, random_weights, tiny  # noqa: E402
from lorafleet.worker.config import ModelConfig  # noqa: E402
from lorafleet.worker.layers.attention import AttentionMetadata  # noqa: E402
from lorafleet.worker.models.registry import MODEL_CLASSES  # noqa: E402

BLOCK_SIZE = 8
# aten ops that launch no kernel: allocations (their contents are written by the next op).
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach"}


class LaunchCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (by name) and, through `triton_launches`, Triton's."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and not func.is_view and name not in NO_KERNEL:
            self.ops["aten." + name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_launches(self) -> Iterator[None]:
        """Each `kernel[grid](...)` launch counted by its kernel's name (compiled or interpreted)."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        counter = self
        originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

        def wrap(run):
            def counted(fn, *args, **kwargs):
                if not kwargs.get("warmup", False):
                    counter.ops["triton." + getattr(fn, "__name__", "kernel")] += 1
                counter.inside_triton += 1
                try:
                    return run(fn, *args, **kwargs)
                finally:
                    counter.inside_triton -= 1
            return counted

        for cls, run in originals.items():
            cls.run = wrap(run)
        try:
            yield
        finally:
            for cls, run in originals.items():
                cls.run = run


def build_model(arch: str, layers: int, backend: str, device: torch.device):
    shape = dict(tiny(SHAPES[arch]), num_hidden_layers=layers, max_position_embeddings=256)
    config = ModelConfig.from_dict(shape)
    model = MODEL_CLASSES[config.model_type](config, device, torch.float32, max_positions=256)
    model.load_weights(random_weights(config, device.type))
    model.attention_backend = backend
    return model


def decode_step_ops(arch: str, layers: int, backend: str, batch: int, context: int = 12) -> Counter[str]:
    """The launches of one decode step of `batch` sequences at `context` tokens each (the 2nd step
    run: the 1st compiles on a GPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(arch, layers, backend, device)
    c = model.config
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    caches = [(torch.zeros(batch * blocks_per_seq + 1, BLOCK_SIZE, c.num_kv_heads, c.head_dim, device=device),
               torch.zeros(batch * blocks_per_seq + 1, BLOCK_SIZE, c.num_kv_heads, c.head_dim, device=device))
              for _ in range(c.num_layers)]
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    ids = torch.arange(batch, device=device) + 3
    positions = torch.full((batch,), context, device=device)
    attn = AttentionMetadata(query_lens=[1] * batch, context_lens=[context + 1] * batch,
                             query_start=list(range(batch + 1)),
                             slot_mapping=tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE,
                             block_tables=tables, context_lens_t=torch.full((batch,), context + 1, device=device).int(),
                             all_decode=True, fixed_shapes=True)
    rows = torch.arange(batch, device=device)  # the logits rows
    counter = LaunchCounter()
    with torch.inference_mode():
        for _ in range(2):
            counter.ops.clear()
            with counter.triton_launches(), counter:
                model.forward(ids, positions, attn, caches, None, rows, graph=True)
    return counter.ops


def layer_counts(arch: str, backend: str, batch: int) -> dict:
    one, two = decode_step_ops(arch, 1, backend, batch), decode_step_ops(arch, 2, backend, batch)
    per_layer = two - one
    return {"arch": arch, "backend": backend, "per_layer": sum(per_layer.values()),
            "per_step_other": sum(one.values()) - sum(per_layer.values()),
            "layer_ops": dict(sorted(per_layer.items())), "step_ops": dict(sorted((one - per_layer).items()))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="llama,gemma2")
    ap.add_argument("--backends", default="torch,triton")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [layer_counts(a, b, args.batch) for b in args.backends.split(",") if b
            for a in args.archs.split(",") if a]
    print(f"{'arch':<8} {'backend':<7} {'per layer':>9} {'rest of step':>12}  per-layer launches")
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in r["layer_ops"].items())
        print(f"{r['arch']:<8} {r['backend']:<7} {r['per_layer']:>9} {r['per_step_other']:>12}  {ops}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

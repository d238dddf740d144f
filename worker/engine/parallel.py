"""Tensor parallelism's process model (docs/tensor_parallel.md): rank 0 is the engine and broadcasts
each model call (forward, slot fill, slot clear, a DoRA adapter's scales, a decode graph's capture
and replay) to ranks 1..N-1, which run `follow` and never decide anything.

Commands travel over a gloo group (CPU tensors, pickled) whatever the compute backend; the forward's
collectives run on the default group (NCCL on CUDA, gloo on CPU). Every rank runs the commands in
rank 0's order, so the collectives inside them line up.

Decode graphs: every rank holds its own, rank 0 leading (worker/engine/rank_graphs.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.engine.rank_graphs import RankGraphs, gather_counts
from lorafleet.worker.layers.quant import load_weights, read_quantization_config, resolve_scheme
from lorafleet.worker.lora.dora import LoopDoraScales
from lorafleet.worker.lora.slots import LoraSlots
from lorafleet.worker.lora.weights import LoraWeights, ModuleWeights
from lorafleet.worker.models.dummy import checkpoint_tensors
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.models.registry import model_class
from lorafleet.worker.models.sharding import Shard, shard_checkpoint, shard_config, shard_lora
from lorafleet.worker.models.tensor_parallel import build_sharded, quantize_sharded, sharded_dora_scales

log = logging.getLogger(__name__)

STOP = ("stop",)


@dataclasses.dataclass(slots=True)
class Group:
    """This process's place in the tensor-parallel group and the gloo group commands travel on."""

    shard: Shard
    commands: object  # a torch.distributed ProcessGroup (gloo)

    @property
    def leader(self) -> bool:
        return self.shard.rank == 0

    def send(self, command: tuple) -> None:
        dist.broadcast_object_list([_to(command, torch.device("cpu"))], src=0, group=self.commands)

    def receive(self) -> tuple:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]


def init_group(rank: int, world: int, init_method: str, device: torch.device, timeout_s: float = 600.0) -> Group:
    """Join the group: NCCL on CUDA (device `cuda:<rank>`), gloo on CPU; plus a gloo group for commands."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    commands = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return Group(Shard(rank, world), commands)


def _to(obj, device: torch.device):
    """`obj` with every tensor inside (tuples, lists, dicts, dataclasses) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


class ShardedLoraSlots(LoraSlots):
    """A rank's slots: the shard config's shapes; a fill cuts the adapter's slice first (S-LoRA).
    On rank 0 a fill or clear is broadcast before it runs here."""

    def __init__(self, full: ModelConfig, group: Group, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(shard_config(full, group.shard.world), num_slots, max_rank, device, dtype)
        self.full = full
        self.group = group

    def fill(self, slot: int, weights: LoraWeights) -> None:
        """`weights.dora_scale`, for a DoRA adapter, holds every rank's scales (`sharded_dora_scales`)."""
        if self.group.leader:
            self.group.send(("fill", slot, _bare(weights)))
        local = shard_lora(weights, self.full, self.group.shard)
        if weights.dora:
            assert weights.dora_scale is not None  # the registry computed it when it read the adapter
            local.dora_scale = {f: g[self.group.shard.rank] for f, g in weights.dora_scale.items()}
        super().fill(slot, local)

    def clear(self, slot: int) -> None:
        if self.group.leader:
            self.group.send(("clear", slot))
        super().clear(slot)


def _bare(weights: LoraWeights) -> tuple:
    """The adapter as plain data (each rank packs its own slice; the digest is rank 0's to report)."""
    return (weights.path, weights.rank, weights.alpha, weights.use_rslora, weights.dora, weights.dora_scale,
            {key: (m.a, m.b, m.scaling, m.magnitude) for key, m in weights.modules.items()})


def _dressed(bare: tuple) -> LoraWeights:
    path, rank, alpha, use_rslora, dora, dora_scale, modules = bare
    return LoraWeights(path=path, rank=rank, alpha=alpha, use_rslora=use_rslora, digest="", dora=dora,
                       dora_scale=dora_scale,
                       modules={key: ModuleWeights(a=a, b=b, scaling=s, magnitude=mag)
                                for key, (a, b, s, mag) in modules.items()})


def leader_dora(model: LlamaModel, group: Group, full: ModelConfig) -> LoopDoraScales:
    """Rank 0's DoRA scales for the registry: the adapter broadcast, then every rank computes its
    rows' scales together (`sharded_dora_scales`: a collective, so on the engine loop only)."""

    def scales(weights: LoraWeights) -> dict[str, torch.Tensor]:
        group.send(("dora", _bare(weights)))
        out = sharded_dora_scales(model, full, weights)
        assert out is not None  # rank 0
        return out

    return scales


def build_rank_model(full: ModelConfig, model_dir: str | Path, group: Group, device: torch.device, dtype: torch.dtype,
                     max_positions: int, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                     quantization: str | None = None, load_format: str = "auto") -> LlamaModel:
    """This rank's shard of the model, its weights cut as they are read; FP8 as `--quantization` and
    the checkpoint say (an FP8 checkpoint's scales cut with their rows; quantized at load per whole row)."""
    model = build_sharded(model_class(full), full, group.shard, device, dtype, max_positions)
    if weights is None:
        weights = checkpoint_tensors(model, full, model_dir, load_format, device, dtype)
    named = shard_checkpoint(weights, full, group.shard)
    qc = read_quantization_config(model_dir)
    scheme, stored = resolve_scheme(quantization, qc)
    if scheme is not None and not stored:
        model.load_weights(named)
        quantize_sharded(model)
    else:
        load_weights(model, named, quantization, qc)
    return model


def lead(model: LlamaModel, group: Group) -> None:
    """Rank 0: broadcast each forward's inputs before running it."""

    def on_step(input_ids, positions, attn, lora_meta, logits_indices) -> None:
        group.send(("forward", input_ids, positions, _bare_attn(attn), lora_meta, logits_indices))

    model.on_step = on_step  # type: ignore[attr-defined]


def _bare_attn(attn):
    """The attention metadata without its per-step plans (each rank makes its own in the first layer)."""
    return dataclasses.replace(attn, prefill_plan=None, window_plans={})


def start_kv(group: Group, num_blocks: int, block_size: int) -> None:
    """Rank 0: tell the other ranks the KV cache's size (after it planned it)."""
    group.send(("kv", num_blocks, block_size))


def stop(group: Group) -> None:
    """Rank 0: let the other ranks return from `follow`."""
    group.send(STOP)


def follow(model_dir: str | Path, config: EngineConfig, group: Group,
           weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Ranks 1..N-1: build the shard, then run rank 0's commands until it says stop."""
    from lorafleet.worker.engine.device_setup import resolve_dtype, resolve_lora_backend
    from lorafleet.worker.layers.attention import resolve_attention_backend

    full = ModelConfig.from_folder(model_dir)
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, full, device)
    max_len = min(config.max_model_len or full.max_position_embeddings, full.max_position_embeddings)
    model = build_rank_model(full, model_dir, group, device, dtype, max_len, weights, config.quantization,
                             config.load_format)
    model.lora_backend = resolve_lora_backend(config.lora_backend, device)
    model.attention_backend = resolve_attention_backend(config.attention_backend, device)
    model.lora = ShardedLoraSlots(full, group, config.max_loras, config.max_lora_rank, device, dtype)
    c = model.config
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    graphs: RankGraphs | None = None
    eager = 0  # forwards run op by op (the graph steps are counted by `graphs`)
    with torch.inference_mode():
        while True:
            command = group.receive()
            kind = command[0]
            if kind == "stop":
                return
            if kind == "forward":
                input_ids, positions, attn, lora_meta, rows = _to(command[1:], device)
                model.forward(input_ids, positions, attn, kv_caches, lora_meta, rows)
                eager += 1
            elif kind == "graph":
                assert graphs is not None
                graphs.follow_step(*command[1:])
            elif kind == "capture":
                assert graphs is not None
                graphs.capture_graph(*command[1:])
            elif kind == "graphs":
                graphs = RankGraphs(model, kv_caches, group, **command[1])
            elif kind == "counts":
                gather_counts(group, graphs, eager)
            elif kind == "fill":
                model.lora.fill(command[1], _dressed(command[2]))
            elif kind == "clear":
                model.lora.clear(command[1])
            elif kind == "dora":
                sharded_dora_scales(model, full, _dressed(command[1]))
            elif kind == "kv":
                shape = (command[1] + 1, command[2], c.num_kv_heads, c.head_dim)  # + the graph sink block
                kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                             for _ in range(c.num_layers)]
            else:
                raise ConfigError(f"tensor-parallel rank {group.shard.rank}: unknown command {kind!r}")


def tp_leader_model(full: ModelConfig, model_dir: str | Path, config: EngineConfig, group: Group | None,
                    device: torch.device, dtype: torch.dtype, max_positions: int,
                    weights: Iterable[tuple[str, torch.Tensor]] | None) -> LlamaModel:
    """Rank 0's shard of the model, its forwards broadcast to the other ranks."""
    if group is None or group.shard.world != config.tensor_parallel_size or not group.leader:
        raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size}: the engine must run as rank 0 "
                          "of a group of that size (lorafleet worker starts the other ranks)")
    model = build_rank_model(full, model_dir, group, device, dtype, max_positions, weights, config.quantization,
                             config.load_format)
    lead(model, group)
    return model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_followers(model_dir: str | Path, config: EngineConfig, init_method: str) -> list:
    """Start ranks 1..N-1 as child processes (`main`); rank 0 is the caller. Returns their Popens."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-m", "lorafleet.worker.engine.parallel",
                              *follower_args(model_dir, config, init_method, rank)])
            for rank in range(1, config.tensor_parallel_size)]


def follower_args(model_dir: str | Path, config: EngineConfig, init_method: str, rank: int) -> list[str]:
    """`main`'s arguments for `rank`."""
    import json

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["pinned_adapters"] = list(config.pinned_adapters)
    return ["--rank", str(rank), "--world", str(config.tensor_parallel_size), "--init-method", init_method,
            "--model", str(model_dir), "--engine-config", json.dumps(fields)]


@dataclasses.dataclass(slots=True)
class Ranks:
    """Rank 0's view of the group it started: the group and ranks 1..N-1's processes."""

    group: Group
    followers: list
    stopping: bool = False  # rank 0 asked the others to return: their exits are no failure

    @classmethod
    def start(cls, model_dir: str | Path, config: EngineConfig) -> Ranks:
        """Start ranks 1..N-1 and join them as rank 0 (blocks until every rank has joined)."""
        world = config.tensor_parallel_size
        device = torch.device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ConfigError(f"--tensor-parallel-size {world} needs {world} CUDA devices; "
                              f"{torch.cuda.device_count()} visible")
        import threading

        init = f"tcp://127.0.0.1:{free_port()}"
        followers = start_followers(model_dir, config, init)
        joined: list = []
        # Joining blocks until every rank has joined: watch the others meanwhile, so a rank that
        # dies before joining fails the start at once instead of after the group's timeout.
        joiner = threading.Thread(target=lambda: joined.append(_try(init_group, 0, world, init, device)), daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.2)
            dead = [(r, p.poll()) for r, p in enumerate(followers, start=1) if p.poll() is not None]
            if dead and joiner.is_alive():
                for p in followers:
                    p.kill()
                rank, code = dead[0]
                raise ConfigError(f"--tensor-parallel-size {world}: rank {rank} exited with code {code} before "
                                  "joining the group (its log says why)")
        result = joined[0]
        if isinstance(result, BaseException):
            for p in followers:
                p.kill()
            raise result
        return cls(result, followers)

    def failure(self) -> str | None:
        """Why the group is broken (a rank has exited), or None while every rank runs."""
        if self.stopping:
            return None
        for rank, p in enumerate(self.followers, start=1):
            code = p.poll()
            if code is not None:
                return (f"tensor-parallel rank {rank} of {self.group.shard.world} exited with code {code} "
                        "(its log says why); every rank stops")
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the other ranks to return (if they still can), close the group, reap them."""
        import subprocess

        if self.failure() is None:
            self.stopping = True
            try:
                stop(self.group)
            except Exception as e:  # noqa: BLE001 - a rank died meanwhile: it is reaped below
                log.warning("tensor-parallel stop: %s", e)
        for p in self.followers:
            if p.poll() is None:
                try:
                    p.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def _try(fn, *args):
    """fn(*args), or the exception it raised (for a thread's caller to raise)."""
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        return e


def main(argv: list[str] | None = None) -> int:
    """One of ranks 1..N-1, as `lorafleet worker --tensor-parallel-size N` starts it:
    `python -m lorafleet.worker.engine.parallel --rank R --world N --init-method tcp://HOST:PORT
    --model DIR --engine-config JSON` (the EngineConfig's fields; device `cuda` means `cuda:R`)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="lorafleet-tp-rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--engine-config", default="{}")
    args = p.parse_args(argv)
    fields = json.loads(args.engine_config)
    fields["pinned_adapters"] = tuple(fields.get("pinned_adapters", ()))
    config = EngineConfig(**fields)
    if config.device.startswith("cuda"):
        config = dataclasses.replace(config, device=f"cuda:{args.rank}")
    try:
        ModelConfig.from_folder(args.model)  # before joining: a bad folder fails the start at once
    except (ConfigError, OSError) as e:
        print(f"tensor-parallel rank {args.rank} of {args.world} failed: {e}", file=sys.stderr)
        return 1
    group = init_group(args.rank, args.world, args.init_method, torch.device(config.device))
    try:
        follow(args.model, config, group)
    except Exception as e:  # noqa: BLE001 - the supervisor reads the reason and stops every rank
        print(f"tensor-parallel rank {args.rank} of {args.world} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode graphs under tensor parallelism (docs/tensor_parallel.md, "Decode graphs per rank"): every
rank holds its own `DecodeGraphs` over its shard (static buffers, captured graphs, memory pool).

Rank 0 picks each step's graph (bucket, LoRA chunk class, rank class, one-pair flag, DoRA or not)
and when to capture one; before capturing it tells the others to capture the same graph, so every
rank captures the same collectives in the same order (NCCL requires it), and before each replay it
sends the step's inputs without their padding (`graph_inputs.PackedInputs`), from which each rank
fills its buffers exactly as rank 0 does and builds the same LoRA metadata (the slots are rank 0's:
fills name them). The commands travel on worker/engine/parallel.py's group; its `follow` runs them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from lorafleet.kernels.lora.meta import LoraMeta, build_lora_meta
from lorafleet.worker.engine.cuda_graphs import DecodeGraphs, DecodeOutput, GraphKey, _Captured
from lorafleet.worker.engine.graph_inputs import DecodeInputs, pack_inputs, unpack_inputs
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.models.sharding import Shard


class Commands(Protocol):
    """The group rank 0's commands travel on (`parallel.Group`)."""

    shard: Shard
    commands: object

    @property
    def leader(self) -> bool: ...

    def send(self, command: tuple) -> None: ...


class RankGraphs(DecodeGraphs):
    """A rank's decode graphs. On rank 0 each capture and replay is first broadcast (module
    docstring); the other ranks' `follow` calls `capture_graph` and `replay` with rank 0's choices."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], group: Commands,
                 **sizes) -> None:
        super().__init__(model, kv_caches, **sizes)
        self.group = group
        self.warmed = False  # the warm-up collective has run (before the first capture)
        if not group.leader:
            self.pick_in_graph = False  # rank 0 samples: the others get no logits rows back

    def capture_graph(self, key: GraphKey, dora: bool) -> _Captured:
        if self.group.leader:
            self.group.send(("capture", key, dora))
        if self.capture and not self.warmed:
            # NCCL's communicator must exist, and every rank be at this point, before a collective is
            # captured: one collective outside any graph, waited for.
            self.model.comm.all_reduce(torch.zeros(1, device=self.model.device))  # type: ignore[attr-defined]
            torch.cuda.synchronize(self.model.device)
            self.warmed = True
        bucket, cls, rank_cls, one_pair = key
        try:
            return super().capture_graph(key, dora)
        except Exception as e:
            raise RuntimeError(f"tensor-parallel rank {self.group.shard.rank}: capturing the decode graph of bucket "
                               f"{bucket}, LoRA chunk class {cls}, rank class {rank_cls}"
                               f"{', one-pair chunks' if one_pair else ''}{', DoRA' if dora else ''} failed: "
                               f"{type(e).__name__}: {e}") from e

    def replay(self, key: GraphKey, dora: bool, inputs: DecodeInputs, step_meta: LoraMeta | None,
               input_ids: torch.Tensor | None = None) -> DecodeOutput:
        if self.group.leader:
            assert input_ids is None  # async scheduling is off under tensor parallelism (engine.py)
            if key not in (self._dora_graphs if dora else self._graphs):
                self.capture_graph(key, dora)  # announced before the step that replays it
            self.group.send(("graph", key, dora, pack_inputs(inputs)))
        return super().replay(key, dora, inputs, step_meta, input_ids)

    def follow_step(self, key: GraphKey, dora: bool, packed) -> None:
        """Ranks 1..N-1: rank 0's graph step -> the same buffers filled, the same graph replayed."""
        if key not in (self._dora_graphs if dora else self._graphs):
            raise RuntimeError(f"tensor-parallel rank {self.group.shard.rank}: rank 0 replays the decode graph "
                               f"{key} (DoRA {dora}), which it never had this rank capture")
        bucket = key[0]
        inputs = unpack_inputs(packed, bucket, self.width, self.block_size, self.k, self.sink_slot,
                               self.logits_len(bucket))
        step_meta = None
        if inputs.has_adapters:  # as rank 0 decided: the same slots and scales give the same metadata
            step_meta = build_lora_meta(inputs.token_slots, inputs.token_scales, self.max_loras, "cpu")
        self.replay(key, dora, inputs, step_meta)

    def counts(self) -> dict[str, int]:
        """Steps replayed and graphs held (captured, on CUDA)."""
        return {"replays": self.stats.replays, "graphs": len(self._graphs) + len(self._dora_graphs)}


def lead_graphs(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], group: Commands,
                sizes: dict) -> RankGraphs:
    """Rank 0's decode graphs; the other ranks make theirs with the same sizes."""
    group.send(("graphs", sizes))
    return RankGraphs(model, kv_caches, group, **sizes)


def graph_counts(group: Commands, graphs: RankGraphs | None, eager: int) -> list[dict[str, int]]:
    """Rank 0: every rank's graph steps (`replays`), graphs held (`graphs`) and forwards run op by
    op (`eager`; rank 0's given, the others count theirs), in rank order. All ranks answer together."""
    group.send(("counts",))
    return gather_counts(group, graphs, eager)


def gather_counts(group: Commands, graphs: RankGraphs | None, eager: int) -> list[dict[str, int]]:
    """This rank's counts gathered to rank 0 (every rank's there, [] on the others)."""
    mine = {"replays": 0, "graphs": 0} if graphs is None else graphs.counts()
    mine["eager"] = eager
    box: list | None = [None] * group.shard.world if group.leader else None
    dist.gather_object(mine, box, dst=0, group=group.commands)
    return box or []

"""Read a PEFT LoRA folder into tensors, validating everything before anything is evicted.

Only safetensors are read (a pickled `.bin`/`.pt` is refused, never unpickled). Every failure is an
`AdapterError` whose `reason` is a stable code (for metrics, HTTP errors, CR conditions) and whose
message says what to fix.

The weights file is read once, by a few threads into buffers of our own (`file_bytes`), its header
validated with the safetensors library's rules (`safetensors_view`), the tensors zero-copy views
of those bytes. For a registry with GPU slots the bytes go on to the GPU chunk by chunk while the
rest is still being read, the host plans the layout meanwhile (`packing.plan_pack`), and the
registry lays the adapter out on the GPU once the last chunk is there: on the H200 machine the
host's own copies were most of a load (docs/benchmarks.md, "Cold adapter loads"). Once the
tensors are checked against the model and `prepare` has run (the registry lays them out for the
slots and checks them), their sha256 starts in a thread over the same bytes (`digest`), and the
load returns without waiting for it (`Digest`). Not before: on the H200 machine a hash running
beside the packing slowed it by ~30 ms (the packing's multi-threaded torch ops wait for their
slowest thread); what waits for the value (a same-name load's conflict check) now waits for the
packing plus the hash, not the longer of the two. An unchanged folder read again reuses its
digest (`DIGEST_CACHE`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorafleet.worker.config import LORA_TARGETS, ModelConfig
from lorafleet.worker.lora.digest import DIGEST_CACHE, Digest, Sha256Thread
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.file_bytes import FileBytes, FileRead
from lorafleet.worker.lora.safetensors_view import TensorInfo, parse_safetensors, tensor_view

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
# A read for the GPU goes there in pinned chunks of this size, each copied as soon as it is read
# (a power of two: the caching host allocator rounds blocks up to one).
UPLOAD_CHUNK_BYTES = 16 << 20
# On a GPU, make the modules' views and let `prepare` plan while the file is still being read
# (False: only once all of it is read; for A/B runs, see bench/adapter_load.py).
PLAN_WHILE_READING = True

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# Config keys that change the maths in ways we do not implement; each must be off/empty.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA adapters are not supported",
    "lora_bias": "LoRA bias terms are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) adapters are not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (parameter-level LoRA) is not supported",
    "trainable_token_indices": "trainable token indices are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
}
if TYPE_CHECKING:
    from lorafleet.worker.lora.packing import PackedLora


@dataclass(slots=True)
class ModuleWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class LoraWeights:
    """A validated adapter in CPU memory."""

    path: str
    rank: int  # the config's `r` (modules may differ through rank_pattern)
    alpha: float
    use_rslora: bool
    # "sha256:<hex>" over config, NUL, weights, NUL; may still be hashing (`Digest.value` waits).
    digest: Digest
    modules: dict[tuple[int, str], ModuleWeights] = field(default_factory=dict)  # (layer, target) ->
    # The slot layout (`packing.pack_weights`): set by `AdapterRegistry.read`/`insert_cpu`. Once the
    # adapter is in the CPU cache, `modules` are views into it (B scaled, in the slot dtype).
    packed: PackedLora | None = None

    def __post_init__(self) -> None:
        if isinstance(self.digest, str):
            self.digest = Digest(self.digest)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.modules}


def adapter_digest(folder: Path) -> str:
    """sha256 over config, NUL, weights, NUL (what `load_adapter` computes from the bytes it reads)."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def _pattern_value(patterns: dict, module_path: str, default):
    # PEFT's rule: a pattern key matches a module whose dotted path ends with it.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def read_adapter_config(folder: Path, max_lora_rank: int) -> dict:
    return parse_adapter_config(_read_config_bytes(folder), max_lora_rank)


def _read_config_bytes(folder: Path) -> bytes:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError("missing_config", f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder")
    return path.read_bytes()


def parse_adapter_config(raw: bytes, max_lora_rank: int, model: ModelConfig | None = None) -> dict:
    """Validate adapter_config.json's bytes (the same bytes the digest covers); target modules
    against `model`'s family (`ModelConfig.adapter_targets`) when given, else the unfused names."""
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError("bad_config", f"{CONFIG_FILE} must be a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise AdapterError("not_lora", f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    for key, message in _UNSUPPORTED_FLAGS.items():
        if cfg.get(key):
            raise AdapterError("unsupported", f"{message} ({key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise AdapterError("unsupported", f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError("bad_rank", f"r must be a positive integer, got {r!r}")
    ranks = [r, *cfg.get("rank_pattern", {}).values()]
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterError("bad_rank", f"rank_pattern values must be positive integers, got {rank!r}")
    if max(ranks) > max_lora_rank:
        raise AdapterError("rank_too_high", f"adapter rank {max(ranks)} exceeds max_lora_rank {max_lora_rank}")
    alphas = [cfg.get("lora_alpha"), *cfg.get("alpha_pattern", {}).values()]
    for alpha in alphas:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise AdapterError("bad_alpha", f"lora_alpha must be a finite number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise AdapterError("bad_targets", f"target_modules is a regex string ({targets!r}); list module names instead")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError("bad_targets", "target_modules must be a non-empty list of module names")
    allowed = model.adapter_targets if model is not None else LORA_TARGETS
    unknown = sorted(set(targets) - set(allowed))
    if unknown:
        raise AdapterError(
            "bad_targets", f"target_modules {unknown} are not in this model (supported: {', '.join(allowed)})"
        )
    return cfg



def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`: one vectorized pass (min/max propagate NaN), any device."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    if t.device.type == "cpu":
        try:
            lo, hi = torch.aminmax(t.reshape(-1))
            return math.isfinite(lo.item()) and math.isfinite(hi.item())
        except (RuntimeError, NotImplementedError):  # dtypes without a CPU aminmax (float8)
            pass
    if t.element_size() == 1:  # float8: no isfinite kernel for it
        t = t.float()
    return bool(torch.isfinite(t).all())


def non_finite_module(weights: LoraWeights) -> str | None:
    """The first module (sorted) whose A or B holds NaN or Inf, as "layer L target", else None."""
    for (layer, target), m in sorted(weights.modules.items()):
        if not (all_finite(m.a) and all_finite(m.b)):
            return f"layer {layer} {target}"
    return None


def load_adapter(
    path: str | Path,
    model: ModelConfig,
    max_lora_rank: int,
    max_bytes: int,
    prepare: Callable[[LoraWeights], Callable[[], None]] | None = None,
    device: torch.device | None = None,
) -> LoraWeights:
    """Validate and read a PEFT adapter folder; raises AdapterError with a reason on any problem.

    The weights file is read once (`FileRead`) and the modules are zero-copy views of its bytes: on
    the host, or with a CUDA `device`, of one copy of the file on that GPU, made chunk by chunk on
    the current stream as the chunks land (pinned; the caller owns that stream and syncs it before
    the host reads anything derived from the modules).

    `prepare(weights)`, if given, owns the finiteness check (the registry lays the adapter out for
    its slots and checks that copy): it is called once the modules are known and returns what to
    run once their bytes are all there. On a GPU it is called while the file is still being read,
    so it may plan (views, buffers) but must not read the modules; what it returns runs after the
    last chunk's copy is queued, ordered after it on the stream. Without `prepare` the weights are
    checked here, vectorized over each run of same-dtype tensors. The digest starts after that.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError("not_found", f"adapter folder {path} does not exist")
    config_bytes = _read_config_bytes(folder)
    cfg = parse_adapter_config(config_bytes, max_lora_rank, model)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [n for n in PICKLE_FILES if (folder / n).exists()]
        if pickled:
            raise AdapterError("pickle", f"{pickled[0]} is a pickle; only {WEIGHTS_FILE} is accepted (pickles can run code)")
        raise AdapterError("missing_weights", f"{folder} has no {WEIGHTS_FILE}")
    identity = DIGEST_CACHE.key(folder / CONFIG_FILE, weights_path)  # before the bytes are read
    cached = DIGEST_CACHE.get(identity)
    gpu = device is not None and device.type == "cuda"
    with FileRead(weights_path, max_bytes=max_bytes, pin=gpu,
                  chunk_bytes=UPLOAD_CHUNK_BYTES if gpu else 0) as reading:
        infos = parse_safetensors(reading, WEIGHTS_FILE)  # waits for the header's bytes only
        upload = _Upload(device, len(reading)) if gpu else None
        # Views of bytes still on their way are only safe on the GPU (the work on them is queued
        # after the copies), and only without a misaligned tensor (tensor_view copies those).
        early = PLAN_WHILE_READING and upload is not None and upload.raw is not None and all(
            i.dtype is None or i.begin % i.dtype.itemsize == 0 for i in infos)
        if early:
            base = upload.raw
        else:
            file = reading.finish(upload)
            base = upload.raw if upload is not None and upload.raw is not None else _host_base(file)
        out, runs = _read_weights(folder, base, infos, cfg, model)
        then = prepare(out) if prepare is not None else partial(_check_finite_raw, out, runs)
        if early:
            file = reading.finish(upload)
        then()
    del runs, then
    # The same bytes that were parsed: one read, hashed in a thread that the load does not wait for
    # (`Digest`). Skipped when unchanged files were hashed before. The digest is cached only if the
    # files are still unchanged once the hash is complete.
    def unchanged() -> bool:
        try:
            return DIGEST_CACHE.key(folder / CONFIG_FILE, weights_path) == identity
        except OSError:  # removed (or unreadable) since: the bytes read stay valid, the cache entry would not
            return False

    def remember(hexdigest: str) -> None:
        if unchanged():
            DIGEST_CACHE.put(identity, "sha256:" + hexdigest)

    parts = (config_bytes, b"\0", *file.buffers(), b"\0")
    if cached is None:
        digest = Digest(Sha256Thread(parts, on_done=remember))
    elif not unchanged():
        digest = Digest(Sha256Thread(parts))  # changed between the lookup and the read: hash what was read
    else:
        digest = Digest(cached)
    out.digest = digest
    return out


class _Upload:
    """`FileRead.finish`'s `on_chunk`: one copy of the file on the GPU (`raw`, None if there was
    no room: then the adapter is read on the host), each chunk copied on the current stream as
    soon as it is read, so the copies overlap the rest of the read."""

    def __init__(self, device: torch.device, size: int) -> None:
        try:  # whole 8-byte words, so the packing can view it as any float dtype
            self.raw: torch.Tensor | None = torch.empty(-(-size // 8) * 8, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            self.raw = None

    def __call__(self, offset: int, size: int, chunk: torch.Tensor) -> None:
        if self.raw is not None:
            self.raw[offset : offset + chunk.numel()].copy_(chunk, non_blocking=True)


def _host_base(file: FileBytes) -> torch.Tensor:
    """The file's bytes as one host tensor (its one chunk, unless it was read in several)."""
    if not file.chunks:
        return torch.empty(0, dtype=torch.uint8)
    return file.chunks[0] if len(file.chunks) == 1 else torch.cat(file.chunks)


def _read_weights(
    folder: Path, base: torch.Tensor, infos: list[TensorInfo], cfg: dict, model: ModelConfig
) -> tuple[LoraWeights, list[torch.Tensor]]:
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    targets = set(cfg["target_modules"])
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    typed: dict = {}  # `base` as each dtype (tensor_view)
    for info in sorted(infos, key=lambda i: i.name):
        name = info.name
        m = _TENSOR_NAME.match(name)
        if not m:
            raise AdapterError("bad_tensor", f"tensor {name!r} is not a LoRA A/B weight of a supported module")
        layer, target, half = int(m.group(1)), m.group(2), m.group(3)
        if target not in targets:
            raise AdapterError("bad_tensor", f"tensor {name!r} targets {target}, which is not in target_modules")
        if layer >= model.num_layers:
            raise AdapterError("shape_mismatch", f"tensor {name!r}: the base model has {model.num_layers} layers")
        if info.dtype is None:
            raise AdapterError("bad_weights", f"tensor {name!r}: weights must be floating point")
        halves.setdefault((layer, target), {})[half] = tensor_view(base, info, typed)
    if not halves:
        raise AdapterError("bad_weights", f"{WEIGHTS_FILE} holds no LoRA tensors")

    out = LoraWeights(path=str(folder), rank=cfg["r"], alpha=float(cfg["lora_alpha"]), use_rslora=rslora,
                      digest=Digest(""))
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError("bad_weights", f"layer {layer} {target} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        module_path = f"model.layers.{layer}.{'self_attn' if target in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{target}"
        r = _pattern_value(rank_pattern, module_path, cfg["r"])
        alpha = float(_pattern_value(alpha_pattern, module_path, cfg["lora_alpha"]))
        out_dim, in_dim = model.linear_shape(target)
        if a.shape != (r, in_dim) or b.shape != (out_dim, r):
            raise AdapterError(
                "shape_mismatch",
                f"layer {layer} {target}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the base model "
                f"(expected A ({r}, {in_dim}), B ({out_dim}, {r}))",
            )
        if not a.is_floating_point() or not b.is_floating_point():
            raise AdapterError("bad_weights", f"layer {layer} {target}: weights must be floating point")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        # A fused module (Phi-3's qkv_proj, gate_up_proj): each slice takes the shared A and its rows of B.
        row = 0
        for part in model.adapter_targets[target]:
            rows = model.linear_shape(part)[0]
            out.modules[(layer, part)] = ModuleWeights(a=a, b=b[row : row + rows], scaling=scaling)
            row += rows
    return out, _runs(base, infos)


def _runs(base: torch.Tensor, infos: list[TensorInfo]) -> list[torch.Tensor]:
    """The data section as few flat views as possible: one per run of adjacent same-dtype tensors."""
    runs: list[tuple[torch.dtype, int, int]] = []
    for info in infos:  # file order: contiguous
        if runs and runs[-1][0] == info.dtype:
            runs[-1] = (info.dtype, runs[-1][1], info.end)
        else:
            runs.append((info.dtype, info.begin, info.end))
    return [tensor_view(base, TensorInfo("", dtype, ((end - begin) // dtype.itemsize,), begin, end))
            for dtype, begin, end in runs]


def _check_finite_raw(weights: LoraWeights, runs: list[torch.Tensor]) -> None:
    if not all(all_finite(run) for run in runs):
        where = non_finite_module(weights) or "a tensor"
        raise AdapterError("bad_weights", f"{where}: weights contain NaN or Inf")

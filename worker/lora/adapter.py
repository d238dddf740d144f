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
import math
import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from lorafleet.worker.config import ModelConfig
from lorafleet.worker.lora.adapter_config import (
    ATTENTION_TARGETS,
    CONFIG_FILE,
    AdapterConfig,
    parse_adapter_config,
)
from lorafleet.worker.lora.adapter_files import MAX_CONFIG_BYTES, open_checked, read_small, within
from lorafleet.worker.lora.digest import DIGEST_CACHE, Digest, Sha256Thread
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.file_bytes import FileBytes, FileRead
from lorafleet.worker.lora.regex_sandbox import RegexSandbox
from lorafleet.worker.lora.safetensors_view import TensorInfo, parse_safetensors, tensor_view
from lorafleet.worker.lora.weights import LoraWeights, ModuleWeights

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
# A read for the GPU goes there in pinned chunks of this size, each copied as soon as it is read
# (a power of two: the caching host allocator rounds blocks up to one).
UPLOAD_CHUNK_BYTES = 16 << 20
# On a GPU, make the modules' views and let `prepare` plan while the file is still being read
# (False: only once all of it is read; for A/B runs, see bench/adapter_load.py).
PLAN_WHILE_READING = True

# PEFT's saved names ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), also without
# the wrapper prefixes or with the adapter name (as vLLM reads them). Layer numbers in ASCII, no
# leading zeros: PEFT would not map "layers.07" or a non-ASCII digit onto a layer.
# A DoRA adapter's magnitude vector is taken under the one name PEFT saves and reads it by,
# "...q_proj.lora_magnitude_vector" (its parameter's ".default.weight" dropped).
_TENSOR_NAME = re.compile(
    r"(?:(?:base_model\.model\.)?model\.)?layers\.(0|[1-9][0-9]{0,8})\.(self_attn|mlp)\.([a-z_]+)"
    r"\.(?:lora_([AB])(?:\.default)?\.weight|lora_(magnitude)_vector(?:\.default)?(?:\.weight)?)"
)  # fullmatch


def adapter_digest(folder: Path) -> str:
    """sha256 over config, NUL, weights, NUL (what `load_adapter` computes from the bytes it reads)."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


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
        if not (all_finite(m.a) and all_finite(m.b) and (m.magnitude is None or all_finite(m.magnitude))):
            return f"layer {layer} {target}"
    return None


def load_adapter(
    path: str | Path,
    model: ModelConfig,
    max_lora_rank: int,
    max_bytes: int,
    prepare: Callable[[LoraWeights], Callable[[], None]] | None = None,
    device: torch.device | None = None,
    *,
    bound: str | Path | None = None,
    regex: RegexSandbox | None = None,
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

    Every file of the adapter must be a regular file resolving inside `bound` (the worker's adapter
    root; None: the adapter's own folder). Regexes of the config run in `regex` (None: a
    temporary sandbox, started only if the config has any). Messages name files by their name in
    the adapter, never by a server path.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError("not_found", "the adapter folder does not exist")
    folder = Path(os.path.realpath(folder))
    bound = Path(os.path.realpath(bound)) if bound is not None else folder
    if not within(str(folder), str(bound)):
        raise AdapterError("link_outside_root", "the adapter folder resolves outside the adapter root")
    config_path = folder / CONFIG_FILE
    if not os.path.lexists(config_path):
        raise AdapterError("missing_config", f"the adapter folder has no {CONFIG_FILE}: not a PEFT adapter folder")
    config_bytes = read_small(config_path, bound, CONFIG_FILE, MAX_CONFIG_BYTES)
    cfg = parse_adapter_config(config_bytes, model, max_lora_rank, regex)
    weights_path = folder / WEIGHTS_FILE
    if not os.path.lexists(weights_path):
        pickled = [n for n in PICKLE_FILES if os.path.lexists(folder / n)]
        if pickled:
            raise AdapterError("pickle", f"{pickled[0]} is a pickle; only {WEIGHTS_FILE} is accepted (pickles can run code)")
        raise AdapterError("missing_weights", f"the adapter folder has no {WEIGHTS_FILE}")
    os.close(open_checked(weights_path, bound, WEIGHTS_FILE))  # a checked file, before its stat is taken
    try:
        identity = DIGEST_CACHE.key(folder / CONFIG_FILE, weights_path)  # before the bytes are read
    except OSError as exc:
        raise AdapterError("unreadable", f"cannot read the adapter's files: {exc.strerror or exc}") from None
    cached = DIGEST_CACHE.get(identity)
    gpu = device is not None and device.type == "cuda"
    with FileRead(weights_path, max_bytes=max_bytes, pin=gpu,
                  chunk_bytes=UPLOAD_CHUNK_BYTES if gpu else 0, bound=bound) as reading:
        # waits for the header's bytes only; an adapter holds at most an A, a B and (DoRA) a magnitude
        # vector per module (a magnitude without use_dora is refused by name below)
        infos = parse_safetensors(reading, WEIGHTS_FILE, max_tensors=3 * len(cfg.modules))
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
    folder: Path, base: torch.Tensor, infos: list[TensorInfo], cfg: AdapterConfig, model: ModelConfig
) -> tuple[LoraWeights, list[torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    typed: dict = {}  # `base` as each dtype (tensor_view)
    for info in sorted(infos, key=lambda i: i.name):
        name = info.name
        m = _TENSOR_NAME.fullmatch(name)
        if not m or m.group(3) not in model.adapter_targets or m.group(2) != _block(m.group(3)):
            raise AdapterError("bad_tensor", f"tensor {name!r} is not a LoRA A/B weight of a supported module")
        layer, target, half = int(m.group(1)), m.group(3), m.group(4) or "M"
        if half == "M" and not cfg.use_dora:
            raise AdapterError("bad_tensor", f"tensor {name!r} is a DoRA magnitude vector, but the config's "
                               "use_dora is not true")
        if layer >= model.num_layers:
            raise AdapterError("shape_mismatch", f"tensor {name!r}: the base model has {model.num_layers} layers")
        if (layer, target) not in cfg.modules:
            raise AdapterError("bad_tensor", f"tensor {name!r} targets {target}, which is not in target_modules")
        if info.dtype is None or not info.dtype.is_floating_point:
            raise AdapterError("bad_weights", f"tensor {name!r}: weights must be floating point")
        pair = halves.setdefault((layer, target), {})
        if half in pair:
            raise AdapterError("bad_tensor", f"tensor {name!r}: layer {layer} {target} has two "
                               f"{_HALF_NAMES[half]} tensors")
        pair[half] = tensor_view(base, info, typed)
    if not halves:
        raise AdapterError("bad_weights", f"{WEIGHTS_FILE} holds no LoRA tensors")

    out = LoraWeights(path=str(folder), rank=cfg.r, alpha=cfg.alpha, use_rslora=cfg.use_rslora, digest=Digest(""),
                      dora=cfg.use_dora)
    want = {"A", "B", "M"} if cfg.use_dora else {"A", "B"}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != want:
            missing = ", ".join(_HALF_NAMES[h] for h in sorted(want - set(pair)))
            raise AdapterError("bad_weights", f"layer {layer} {target} lacks {missing}"
                               + (" (a DoRA adapter has a magnitude vector per module)" if "M" in want else ""))
        a, b, mag = pair["A"], pair["B"], pair.get("M")
        r, alpha = cfg.modules[(layer, target)]
        out_dim, in_dim = model.linear_shape(target)
        if a.shape != (r, in_dim) or b.shape != (out_dim, r):
            raise AdapterError(
                "shape_mismatch",
                f"layer {layer} {target}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the base model "
                f"(expected A ({r}, {in_dim}), B ({out_dim}, {r}))",
            )
        if mag is not None and mag.shape != (out_dim,):
            raise AdapterError("shape_mismatch", f"layer {layer} {target}: lora_magnitude_vector {tuple(mag.shape)} "
                               f"does not fit the base model (expected ({out_dim},))")
        scaling = cfg.scaling(r, alpha)
        # A fused module (Phi-3's qkv_proj, gate_up_proj): each slice takes the shared A and its rows of B
        # (and of the magnitude: DoRA's norm is per output row, so a slice's rows are its own).
        row = 0
        for part in model.adapter_targets[target]:
            rows = model.linear_shape(part)[0]
            out.modules[(layer, part)] = ModuleWeights(
                a=a, b=b[row : row + rows], scaling=scaling, magnitude=None if mag is None else mag[row : row + rows])
            row += rows
    return out, _runs(base, infos)


_HALF_NAMES = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}


def _block(target: str) -> str:
    return "self_attn" if target in ATTENTION_TARGETS else "mlp"


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

"""Read a PEFT LoRA folder into CPU tensors, validating everything before anything is evicted.

Only safetensors are read (a pickled `.bin`/`.pt` is refused, never unpickled). Every failure is an
`AdapterError` whose `reason` is a stable code (for metrics, HTTP errors, CR conditions) and whose
message says what to fix.

A digest is reused, without hashing, when the same files are read again unchanged (same device,
inode, size, mtime and ctime before and after the read: `DIGEST_CACHE`), as when an adapter
evicted from the CPU cache comes back. The weights file is read once: it is mapped (copy-on-write, so the tensors are zero-copy views of
the page cache and never segfault on a write), its sha256 runs in a thread over the same mapping
(hashlib releases the GIL) while the header is validated, the tensors are checked against the
model and `prepare` (the registry lays them out for the GPU slots and checks them there) runs. The
safetensors header is validated here with the same rules as the safetensors library
(`Metadata::validate`): offsets contiguous from 0 to the end of the file, sizes matching
dtype x shape, a bounded UTF-8 JSON header.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorafleet.worker.config import LORA_TARGETS, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

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
# safetensors dtype names -> torch (those torch has); any other name is refused as bad_weights.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000  # the safetensors library's cap

if TYPE_CHECKING:
    from lorafleet.worker.lora.slots import PackedLora


class AdapterError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
    digest: str  # "sha256:<hex>" over config + weights
    modules: dict[tuple[int, str], ModuleWeights] = field(default_factory=dict)  # (layer, target) ->
    # The slot layout (`slots.pack_weights`): set by `AdapterRegistry.read`/`insert_cpu`. Once the
    # adapter is in the CPU cache, `modules` are views into it (B scaled, in the slot dtype).
    packed: PackedLora | None = None

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


def parse_adapter_config(raw: bytes, max_lora_rank: int) -> dict:
    """Validate adapter_config.json's bytes (the same bytes the digest covers)."""
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
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise AdapterError(
            "bad_targets", f"target_modules {unknown} are not in this model (supported: {', '.join(LORA_TARGETS)})"
        )
    return cfg



# -- reading the weights file once -----------------------------------------------------------------
class _Sha256:
    """sha256 of `parts` in a thread (hashlib releases the GIL on large buffers); `hexdigest` joins it."""

    def __init__(self, parts: Sequence) -> None:
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(parts,), name="adapter-sha256", daemon=True)
        self._thread.start()

    def _run(self, parts: Sequence) -> None:
        try:
            for part in parts:
                self._hash.update(part)
        except BaseException as exc:  # noqa: BLE001 - re-raised by hexdigest on the caller's thread
            self._error = exc

    def hexdigest(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()


class _DigestCache:
    """Digests of adapter folders by file identity: a re-read of unchanged files skips the hash.

    The key is each file's (device, inode, size, mtime, ctime), taken before the read and checked
    again after it (as git's index does); writing a file changes its ctime, which user space
    cannot set back, so changed content always misses. Bounded LRU, shared by the process.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._items: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.capacity = capacity
        self.hits = 0

    @staticmethod
    def key(*paths: Path) -> tuple:
        out = []
        for path in paths:
            st = path.stat()
            out.append((str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)

    def get(self, key: tuple) -> str | None:
        with self._lock:
            digest = self._items.pop(key, None)
            if digest is not None:
                self._items[key] = digest  # most recent last
                self.hits += 1
            return digest

    def put(self, key: tuple, digest: str) -> None:
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = digest
            while len(self._items) > self.capacity:
                self._items.pop(next(iter(self._items)))


DIGEST_CACHE = _DigestCache()


def _map_file(path: Path) -> mmap.mmap | bytes:
    """The whole file, copy-on-write mapped (writes to views stay private); b"" if it is empty."""
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:  # an empty file cannot be mapped
            return b""
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        mapped.madvise(mmap.MADV_WILLNEED)  # start readahead of a cold file while the hash begins
    return mapped


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    name: str
    dtype: torch.dtype | None  # None: a safetensors dtype torch has no type for
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets into the file
    end: int


def _parse_safetensors(buf: mmap.mmap | bytes) -> list[_TensorInfo]:
    """The header's tensors in file order, validated as safetensors validates it (`Metadata::validate`)."""

    def bad(why: str) -> AdapterError:
        return AdapterError("bad_weights", f"{WEIGHTS_FILE} is not a valid safetensors file: {why}")

    size = len(buf)
    if size < 8:
        raise bad("shorter than the 8-byte header length")
    n = int.from_bytes(buf[:8], "little")
    if n > _MAX_HEADER:
        raise bad(f"header of {n} bytes is over the {_MAX_HEADER}-byte limit")
    if 8 + n > size:
        raise bad(f"header length {n} runs past the end of the file ({size} bytes)")
    try:
        text = bytes(buf[8 : 8 + n]).decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the header is not UTF-8") from None
    if not text.startswith("{"):
        raise bad("the header is not a JSON object")
    try:
        header = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"the header is not valid JSON ({exc})") from None
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ must map strings to strings")

    def is_uint(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    infos = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise bad(f"tensor {name!r} needs dtype, shape and data_offsets")
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype_name, str) or not dtype_name.isupper():
            raise bad(f"tensor {name!r} has an unknown dtype {dtype_name!r}")
        if not isinstance(shape, list) or not all(is_uint(d) for d in shape):
            raise bad(f"tensor {name!r} has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_uint(o) for o in offsets)):
            raise bad(f"tensor {name!r} has bad data_offsets {offsets!r}")
        infos.append((tuple(offsets), name, _ST_DTYPES.get(dtype_name), tuple(shape)))
    infos.sort(key=lambda t: t[0])
    out, start = [], 0
    for (begin, end), name, dtype, shape in infos:
        if begin != start or end < begin:
            raise bad(f"tensor {name!r} has data_offsets [{begin}, {end}], expected to start at {start}")
        start = end
        if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise bad(f"tensor {name!r}: {end - begin} bytes do not hold {dtype} {list(shape)}")
        out.append(_TensorInfo(name, dtype, shape, 8 + n + begin, 8 + n + end))
    if 8 + n + start != size:
        raise bad(f"the tensors end at byte {8 + n + start} but the file has {size}")
    return out


def _view(base: torch.Tensor, info: _TensorInfo) -> torch.Tensor:
    """Zero-copy view of a tensor's bytes (copied only if its offset is misaligned for its dtype)."""
    raw = base[info.begin : info.end]
    if info.begin % info.dtype.itemsize:
        raw = raw.clone()
    return raw.view(info.dtype).view(info.shape)


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
    prepare: Callable[[LoraWeights], None] | None = None,
) -> LoraWeights:
    """Validate and read a PEFT adapter folder; raises AdapterError with a reason on any problem.

    The modules are zero-copy views of the mapped file. `prepare`, if given, runs on the validated
    weights while the digest is still being computed, and then owns the finiteness check (the
    registry lays the adapter out for its slots and checks that copy, on the GPU when there is
    one); without it the weights are checked here, vectorized over each run of same-dtype tensors.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError("not_found", f"adapter folder {path} does not exist")
    config_bytes = _read_config_bytes(folder)
    cfg = parse_adapter_config(config_bytes, max_lora_rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [n for n in PICKLE_FILES if (folder / n).exists()]
        if pickled:
            raise AdapterError("pickle", f"{pickled[0]} is a pickle; only {WEIGHTS_FILE} is accepted (pickles can run code)")
        raise AdapterError("missing_weights", f"{folder} has no {WEIGHTS_FILE}")
    identity = DIGEST_CACHE.key(folder / CONFIG_FILE, weights_path)  # before the bytes are read
    cached = DIGEST_CACHE.get(identity)
    size = weights_path.stat().st_size
    if size > max_bytes:
        raise AdapterError("too_large", f"adapter weights are {size} bytes, over the {max_bytes}-byte cap")
    buf = _map_file(weights_path)
    if len(buf) > max_bytes:  # grew since the stat
        raise AdapterError("too_large", f"adapter weights are {len(buf)} bytes, over the {max_bytes}-byte cap")
    # The same bytes that are parsed: one read. Skipped when unchanged files were hashed before.
    sha = None if cached is not None else _Sha256((config_bytes, b"\0", buf, b"\0"))
    try:
        out, runs = _read_weights(folder, buf, cfg, model)
        if prepare is not None:
            prepare(out)
        else:
            _check_finite_raw(out, runs)
        del runs
    finally:
        digest = cached if sha is None else "sha256:" + sha.hexdigest()  # joined before the file is unmapped
    unchanged = DIGEST_CACHE.key(folder / CONFIG_FILE, weights_path) == identity
    if sha is None and not unchanged:  # changed between the lookup and the read: hash what was read
        digest = "sha256:" + _Sha256((config_bytes, b"\0", buf, b"\0")).hexdigest()
    elif sha is not None and unchanged:
        DIGEST_CACHE.put(identity, digest)
    out.digest = digest
    return out


def _read_weights(
    folder: Path, buf: mmap.mmap | bytes, cfg: dict, model: ModelConfig
) -> tuple[LoraWeights, list[torch.Tensor]]:
    infos = _parse_safetensors(buf)
    base = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    targets = set(cfg["target_modules"])
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
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
        halves.setdefault((layer, target), {})[half] = _view(base, info)
    if not halves:
        raise AdapterError("bad_weights", f"{WEIGHTS_FILE} holds no LoRA tensors")

    out = LoraWeights(path=str(folder), rank=cfg["r"], alpha=float(cfg["lora_alpha"]), use_rslora=rslora, digest="")
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
        out.modules[(layer, target)] = ModuleWeights(a=a, b=b, scaling=scaling)
    return out, _runs(base, infos)


def _runs(base: torch.Tensor, infos: list[_TensorInfo]) -> list[torch.Tensor]:
    """The data section as few flat views as possible: one per run of adjacent same-dtype tensors."""
    runs: list[tuple[torch.dtype, int, int]] = []
    for info in infos:  # file order: contiguous
        if runs and runs[-1][0] == info.dtype:
            runs[-1] = (info.dtype, runs[-1][1], info.end)
        else:
            runs.append((info.dtype, info.begin, info.end))
    return [_view(base, _TensorInfo("", dtype, ((end - begin) // dtype.itemsize,), begin, end))
            for dtype, begin, end in runs]


def _check_finite_raw(weights: LoraWeights, runs: list[torch.Tensor]) -> None:
    if not all(all_finite(run) for run in runs):
        where = non_finite_module(weights) or "a tensor"
        raise AdapterError("bad_weights", f"{where}: weights contain NaN or Inf")

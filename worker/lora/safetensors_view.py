"""A safetensors file's header validated with the same rules as the safetensors library
(`Metadata::validate`: offsets contiguous from 0 to the end of the file, sizes matching dtype x
shape, a bounded UTF-8 JSON header), and its tensors as zero-copy views of the bytes read
(`file_bytes.read_file`), wherever those bytes are (host or GPU). Valid headers are kept (the 16
most recently used): the next file with the same header and size is not parsed again."""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Sized
from dataclasses import dataclass

import torch

from lorafleet.worker.lora.errors import AdapterError

# safetensors dtype names -> torch (those torch has); any other name is refused as bad_weights.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}
# Header bytes: the safetensors library allows 100 MB; one json.loads holds the GIL for all of it
# (~16 ms per MB here), stalling the engine's steps, and an adapter of an 80-layer model with every
# target (1,120 tensors) has a header of ~170 KB.
MAX_HEADER_BYTES = 1 << 20
# Headers parsed and found valid, by (header bytes, file size): a fleet's adapters mostly share one
# layout (same rank and targets), and a seed-shape header (448 tensors, 60 KB of JSON) takes 2.5-4.3
# ms of Python to parse and check, in the read's thread, beside the engine loop. A kept header holds
# its bytes and its parsed infos (a crafted 1 MiB header parses into ~6 MB): 256 KiB at most each.
_PARSED: OrderedDict[tuple[bytes, int], tuple[TensorInfo, ...]] = OrderedDict()
_PARSED_MAX = 16  # headers kept, each at most _PARSED_MAX_BYTES
_PARSED_MAX_BYTES = 256 << 10
_PARSED_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: torch.dtype | None  # None: a safetensors dtype torch has no type for
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets into the file
    end: int


def parse_safetensors(buf: Sized, file_name: str, max_tensors: int | None = None) -> list[TensorInfo]:
    """The header's tensors in file order, validated as safetensors validates it. `buf` is the file:
    bytes, or anything sized that slices into bytes (`FileBytes`); `file_name` is for the error
    messages (AdapterError "bad_weights"). Over MAX_HEADER_BYTES or `max_tensors` tensors:
    AdapterError "too_large", before the header is parsed (bytes) or its tensors checked (count)."""

    def bad(why: str) -> AdapterError:
        return AdapterError("bad_weights", f"{file_name} is not a valid safetensors file: {why}")

    size = len(buf)
    if size < 8:
        raise bad("shorter than the 8-byte header length")
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise AdapterError("too_large", f"{file_name} has a header of {n} bytes, over the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > size:
        raise bad(f"header length {n} runs past the end of the file ({size} bytes)")
    raw = bytes(buf[8 : 8 + n])
    with _PARSED_LOCK:
        known = _PARSED.get((raw, size))
        if known is not None:
            _PARSED.move_to_end((raw, size))
    if known is not None:
        _check_count(len(known), max_tensors, file_name)
        return list(known)
    infos = _parse_header(raw, n, size, bad, max_tensors, file_name)
    if n <= _PARSED_MAX_BYTES:
        with _PARSED_LOCK:
            _PARSED[(raw, size)] = tuple(infos)
            if len(_PARSED) > _PARSED_MAX:
                _PARSED.popitem(last=False)
    return infos


def _check_count(count: int, max_tensors: int | None, file_name: str) -> None:
    if max_tensors is not None and count > max_tensors:
        raise AdapterError("too_large", f"{file_name} holds {count} tensors; this adapter's config adapts modules "
                           f"for at most {max_tensors}")


def _parse_header(raw: bytes, n: int, size: int, bad, max_tensors: int | None, file_name: str) -> list[TensorInfo]:
    """`parse_safetensors` past the header's length: its JSON, checked."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the header is not UTF-8") from None
    if not text.startswith("{"):
        raise bad("the header is not a JSON object")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, nesting, int digit limits
        raise bad(f"the header is not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ must map strings to strings")

    def is_uint(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    _check_count(len(header), max_tensors, file_name)
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
        out.append(TensorInfo(name, dtype, shape, 8 + n + begin, 8 + n + end))
    if 8 + n + start != size:
        raise bad(f"the tensors end at byte {8 + n + start} but the file has {size}")
    return out


def tensor_view(base: torch.Tensor, info: TensorInfo, typed: dict | None = None) -> torch.Tensor:
    """Zero-copy view of a tensor's bytes (copied only if its offset is misaligned for its dtype).

    `typed`, a dict kept across calls on one `base`, holds `base` viewed as each dtype: a view is
    then one op (`as_strided`) instead of three, which adds up over an adapter's hundreds of tensors."""
    size = info.dtype.itemsize
    if info.begin % size:
        return base[info.begin : info.end].clone().view(info.dtype).view(info.shape)
    typed = {} if typed is None else typed
    whole = typed.get(info.dtype)
    if whole is None:
        whole = typed[info.dtype] = base[: base.numel() // size * size].view(info.dtype)
    strides, step = [], 1
    for dim in reversed(info.shape):
        strides.append(step)
        step *= dim
    return whole.as_strided(info.shape, strides[::-1], whole.storage_offset() + info.begin // size)

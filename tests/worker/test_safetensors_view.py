"""Reading an adapter's safetensors file: zero-copy views that hold what the safetensors library
loads, malformed files refused as `bad_weights`, tensors at misaligned offsets copied."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.lora import adapter as adapter_mod
from lorafleet.worker.lora.adapter import AdapterError, load_adapter
from tests.worker.lora_harness import WEIGHTS, write_adapter


def test_read_matches_the_safetensors_library(model, tmp_path):
    """Zero-copy views of the bytes read hold exactly what safetensors loads (two dtypes in one file)."""
    folder = write_adapter(tmp_path / "a", model, torch.bfloat16, r=4)
    tensors = load_file(str(folder / WEIGHTS))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = tensors[key].float()  # a float32 B among bf16 tensors
    save_file(tensors, str(folder / WEIGHTS))
    weights = load_adapter(folder, model, 64, 1 << 30)
    for (layer, target), m in weights.modules.items():
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        p = f"base_model.model.model.layers.{layer}.{block}.{target}"
        assert torch.equal(m.a, tensors[p + ".lora_A.weight"]) and m.a.dtype == tensors[p + ".lora_A.weight"].dtype
        assert torch.equal(m.b, tensors[p + ".lora_B.weight"]) and m.b.dtype == tensors[p + ".lora_B.weight"].dtype


@pytest.mark.parametrize("corrupt", ["empty", "short", "header_past_end", "not_json", "not_object", "gap",
                                     "wrong_size", "trailing_bytes", "truncated", "bad_dtype"])
def test_invalid_safetensors_are_bad_weights(corrupt, model, demo_adapters, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(demo_adapters["sql"], folder)
    path = folder / WEIGHTS
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])

    def with_header(h: dict, body: bytes = data[8 + n :]) -> bytes:
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + body

    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    second = min((k for k in header if k not in ("__metadata__", first)), key=lambda k: header[k]["data_offsets"][0])
    if corrupt == "empty":
        data = b""
    elif corrupt == "short":
        data = data[:5]
    elif corrupt == "header_past_end":
        data = (len(data) * 2).to_bytes(8, "little") + data[8:]
    elif corrupt == "not_json":
        data = (5).to_bytes(8, "little") + b"{oops"
    elif corrupt == "not_object":
        data = with_header([1, 2])  # type: ignore[arg-type]
    elif corrupt == "gap":
        header[second]["data_offsets"][0] += 4
        data = with_header(header)
    elif corrupt == "wrong_size":
        header[first]["shape"][0] += 1
        data = with_header(header)
    elif corrupt == "trailing_bytes":
        data += b"\0" * 16
    elif corrupt == "truncated":
        data = data[:-16]
    elif corrupt == "bad_dtype":
        header[first]["dtype"] = "Q7"
        data = with_header(header)
    path.write_bytes(data)
    with pytest.raises(AdapterError) as info:
        load_adapter(folder, model, 64, 1 << 30)
    assert info.value.reason == "bad_weights", str(info.value)


def test_misaligned_tensor_bytes_are_copied(model):
    base = torch.arange(64, dtype=torch.uint8)
    info = adapter_mod.TensorInfo("x", torch.float32, (2, 3), 2, 26)
    got = adapter_mod.tensor_view(base, info)
    assert torch.equal(got, base[2:26].clone().view(torch.float32).view(2, 3))


def test_typed_views_equal_plain_views():
    """Views through the per-dtype cache hold the tensor's bytes, as a copy of them reinterpreted would."""
    base = torch.arange(200, dtype=torch.uint8)
    typed: dict = {}
    infos = [adapter_mod.TensorInfo("a", torch.float32, (2, 3), 8, 32), adapter_mod.TensorInfo("b", torch.bfloat16, (3, 2, 2), 34, 58),
             adapter_mod.TensorInfo("c", torch.float16, (0, 4), 60, 60), adapter_mod.TensorInfo("d", torch.float32, (5,), 61, 81)]
    for info in infos:
        got = adapter_mod.tensor_view(base, info, typed)
        want = base[info.begin : info.end].clone().view(info.dtype).view(info.shape)
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want), info.name
        if info.begin % info.dtype.itemsize == 0:
            assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # a view, not a copy


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def test_valid_headers_are_parsed_once(monkeypatch):
    """A header seen before (same bytes, same file size) comes from the cache, as the same infos; the
    same header over a file of another size is checked again, and refused; invalid headers are never
    kept; the cache keeps the 16 most recently used headers of at most 256 KiB."""
    from lorafleet.worker.lora import safetensors_view as sv

    monkeypatch.setattr(sv, "_PARSED", type(sv._PARSED)())
    data = _safetensors_bytes({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
    first = sv.parse_safetensors(data, "f")
    again = sv.parse_safetensors(data, "f")
    assert again == first and all(x is y for x, y in zip(again, first)) and len(sv._PARSED) == 1
    assert [(i.name, i.dtype, i.shape) for i in first] == [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (4,))]
    with pytest.raises(AdapterError, match="the file has"):
        sv.parse_safetensors(data + b"\0" * 8, "f")
    with pytest.raises(AdapterError, match="do not hold"):
        sv.parse_safetensors(data[:8] + data[8:].replace(b"[2,3]", b"[3,3]"), "f")
    assert len(sv._PARSED) == 1
    key = (bytes(data[8 : 8 + int.from_bytes(data[:8], "little")]), len(data))
    for k in range(20):
        sv.parse_safetensors(_safetensors_bytes({f"t{k}": torch.zeros(1)}), "f")
        if k < 10:
            sv.parse_safetensors(data, "f")  # used again: kept past older entries
    assert len(sv._PARSED) == sv._PARSED_MAX and key in sv._PARSED
    for k in range(20, 36):
        sv.parse_safetensors(_safetensors_bytes({f"t{k}": torch.zeros(1)}), "f")
    assert len(sv._PARSED) == sv._PARSED_MAX and key not in sv._PARSED
    monkeypatch.setattr(sv, "_PARSED_MAX_BYTES", 16)
    sv._PARSED.clear()
    assert sv.parse_safetensors(data, "f") == first and not sv._PARSED

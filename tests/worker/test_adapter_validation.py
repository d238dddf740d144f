"""One real malformed adapter folder per rejection reason; the engine keeps serving through all of them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.lora.adapter import AdapterError


def edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file(fn(tensors), str(path))


def to_pickle(folder: Path) -> None:
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    torch.save(tensors, folder / "adapter_model.bin")
    (folder / "adapter_model.safetensors").unlink()


def first_key(tensors, needle="lora_A"):
    return next(k for k in sorted(tensors) if needle in k)


def rename_first(tensors, new):
    key = first_key(tensors)
    tensors[new] = tensors.pop(key)
    return tensors


def widen_first(tensors):
    key = first_key(tensors)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    return tensors


def poison_first(tensors):
    key = first_key(tensors)
    tensors[key][0, 0] = float("nan")
    return tensors


def drop_first_b(tensors):
    del tensors[first_key(tensors, "lora_B")]
    return tensors


def _link_out(folder: Path, name: str) -> None:
    """The file moved next to the folder (outside it) and linked back in."""
    outside = folder.parent / f"{folder.name}-outside-{name}"
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)


def _fifo(folder: Path, name: str) -> None:
    (folder / name).unlink()
    os.mkfifo(folder / name)


def _dir(folder: Path, name: str) -> None:
    (folder / name).unlink()
    (folder / name).mkdir()


def _broken_link(folder: Path, name: str) -> None:
    (folder / name).unlink()
    (folder / name).symlink_to(folder / "nowhere")


def _duplicate_first(tensors):
    """The first A again under its short name (as many tensors as before: one module dropped)."""
    key = first_key(tensors)
    last = sorted(tensors)[-1].rsplit(".lora_", 1)[0]
    for half in ("lora_A", "lora_B"):
        del tensors[f"{last}.{half}.weight"]
    tensors[key.replace("base_model.model.", "")] = tensors[key].clone()
    return tensors


def _ints_first(tensors):
    key = first_key(tensors)
    tensors[key] = tensors[key].to(torch.int32)
    return tensors


CASES = {
    # name: (how to break a copy of the "sql" adapter, expected reason)
    "dora_without_magnitudes": (lambda f: edit_config(f, use_dora=True), "bad_weights"),
    "pickle_only": (to_pickle, "pickle"),
    "not_lora": (lambda f: edit_config(f, peft_type="IA3"), "not_lora"),
    "bias": (lambda f: edit_config(f, bias="all"), "unsupported"),
    "modules_to_save": (lambda f: edit_config(f, modules_to_save=["lm_head"]), "unsupported"),
    "regex_matches_non_linear": (lambda f: edit_config(f, target_modules=r".*\.self_attn"), "bad_targets"),
    "regex_invalid": (lambda f: edit_config(f, target_modules="(q_proj"), "bad_targets"),
    "regex_no_match": (lambda f: edit_config(f, target_modules="nothing"), "bad_targets"),
    "list_matches_embeddings": (lambda f: edit_config(f, target_modules=["q_proj", "embed_tokens"]), "bad_targets"),
    "activated_lora": (lambda f: edit_config(f, alora_invocation_tokens=[5, 6]), "unsupported"),
    "block_diagonal": (lambda f: edit_config(f, use_bdlora={"nblocks": 2}), "unsupported"),
    "kasa": (lambda f: edit_config(f, kasa_config={}), "unsupported"),
    "pissa_init": (lambda f: edit_config(f, init_lora_weights="pissa"), "unsupported"),
    "unknown_key_on": (lambda f: edit_config(f, use_future_variant=True), "unsupported"),
    "bad_pattern_regex": (lambda f: edit_config(f, rank_pattern={"(q": 4}), "bad_config"),
    "pattern_not_object": (lambda f: edit_config(f, alpha_pattern=["q_proj"]), "bad_config"),
    "deep_json": (lambda f: (f / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000), "bad_config"),
    "huge_int_rank": (lambda f: (f / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ' + "9" * 5000 + "}"),
                      "bad_config"),
    "config_over_cap": (lambda f: (f / "adapter_config.json").write_text(" " * (300 << 10) + "{}"), "too_large"),
    "config_link_outside": (lambda f: _link_out(f, "adapter_config.json"), "link_outside_root"),
    "weights_link_outside": (lambda f: _link_out(f, "adapter_model.safetensors"), "link_outside_root"),
    "config_is_fifo": (lambda f: _fifo(f, "adapter_config.json"), "not_regular_file"),
    "weights_is_fifo": (lambda f: _fifo(f, "adapter_model.safetensors"), "not_regular_file"),
    "config_is_dir": (lambda f: _dir(f, "adapter_config.json"), "not_regular_file"),
    "broken_link": (lambda f: _broken_link(f, "adapter_model.safetensors"), "missing_file"),
    "duplicate_tensor": (lambda f: edit_tensors(f, _duplicate_first), "bad_tensor"),
    "block_mismatch": (lambda f: edit_tensors(f, lambda t: rename_first(t, "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight")), "bad_tensor"),
    "leading_zero_layer": (lambda f: edit_tensors(f, lambda t: rename_first(t, "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight")), "bad_tensor"),
    "int_weights": (lambda f: edit_tensors(f, _ints_first), "bad_weights"),
    "unknown_target": (lambda f: edit_config(f, target_modules=["q_proj", "embed_tokens"]), "bad_targets"),
    "fractional_rank": (lambda f: edit_config(f, r=8.5), "bad_rank"),
    "rank_too_high": (lambda f: edit_config(f, r=128), "rank_too_high"),
    "bad_rank_pattern": (lambda f: edit_config(f, rank_pattern={"q_proj": "big"}), "bad_rank"),
    "nan_alpha": (lambda f: edit_config(f, lora_alpha=float("nan")), "bad_alpha"),
    "string_alpha": (lambda f: edit_config(f, lora_alpha="16"), "bad_alpha"),
    "no_config": (lambda f: (f / "adapter_config.json").unlink(), "missing_config"),
    "broken_json": (lambda f: (f / "adapter_config.json").write_text("{r: 8"), "bad_config"),
    "no_weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "missing_weights"),
    "garbage_weights": (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00" * 64), "bad_weights"),
    "unknown_tensor": (lambda f: edit_tensors(f, lambda t: rename_first(t, "base_model.model.model.layers.0.self_attn.q_proj.lora_embedding_A")), "bad_tensor"),
    "untargeted_tensor": (lambda f: edit_tensors(f, lambda t: rename_first(t, "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")), "bad_tensor"),
    "layer_out_of_range": (lambda f: edit_tensors(f, lambda t: rename_first(t, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight")), "shape_mismatch"),
    "wrong_shape": (lambda f: edit_tensors(f, widen_first), "shape_mismatch"),
    "half_pair": (lambda f: edit_tensors(f, drop_first_b), "bad_weights"),
    "nan_weights": (lambda f: edit_tensors(f, poison_first), "bad_weights"),
}


@pytest.fixture(scope="module")
def engine(demo_model, demo_adapters):
    cfg = EngineConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=64, max_adapter_bytes=1 << 20)
    return LLMEngine(demo_model, cfg, lora_modules={"sql": str(demo_adapters["sql"]), "chat": str(demo_adapters["chat"])})


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_adapter_is_refused_with_its_reason(case, engine, demo_adapters, tmp_path):
    breaker, reason = CASES[case]
    folder = tmp_path / case
    shutil.copytree(demo_adapters["sql"], folder)
    breaker(folder)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    before = engine.generate(["Hello world"], sp, [(("sql", 1.0),)])[0].token_ids
    cpu_before = list(engine.registry.cpu)
    with pytest.raises(AdapterError) as info:
        engine.load_adapter("broken", str(folder))
    assert info.value.reason == reason, str(info.value)
    assert str(info.value)  # a message a person can act on
    assert str(tmp_path) not in str(info.value)  # and no server path
    # Nothing was evicted, nothing registered, and the engine still serves the same answers.
    assert list(engine.registry.cpu) == cpu_before and "broken" not in engine.registry.entries
    assert engine.generate(["Hello world"], sp, [(("sql", 1.0),)])[0].token_ids == before


def test_rank_over_the_worker_limit(demo_model, demo_adapters):
    engine = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=16))
    with pytest.raises(AdapterError, match="rank 32 exceeds max_lora_rank 16") as info:
        engine.load_adapter("code", str(demo_adapters["code"]))
    assert info.value.reason == "rank_too_high"


def test_size_cap(demo_model, demo_adapters):
    engine = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=2, max_adapter_bytes=1000))
    with pytest.raises(AdapterError) as info:
        engine.load_adapter("chat", str(demo_adapters["chat"]))
    assert info.value.reason == "too_large"


def test_missing_folder(engine, tmp_path):
    with pytest.raises(AdapterError) as info:
        engine.load_adapter("ghost", str(tmp_path / "nope"))
    assert info.value.reason == "not_found"

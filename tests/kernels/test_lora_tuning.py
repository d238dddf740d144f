"""The LoRA kernels' tuning as data (`kernels/lora/tuning.py`, `kernels/lora/tunings/*.json`): the
default tuning reproduces the launch configs `pick_config` chose when its knobs were module
constants (recorded over a grid in data/pick_config_grid.json before the change), the device's file
is chosen by name, and LORAFLEET_LORA_TUNING overrides it."""

from __future__ import annotations

import json
from dataclasses import astuple, fields, replace
from pathlib import Path

import pytest

from lorafleet.kernels.lora.config import LoraKernelConfig, pick_config
from lorafleet.kernels.lora.tuning import (
    TUNINGS_DIR,
    LoraTuning,
    active_tuning,
    device_file,
    load_tuning,
    tuning_env,
    tuning_from_dict,
    tuning_to_dict,
)

GRID = Path(__file__).with_name("data") / "pick_config_grid.json"


def test_default_tuning_reproduces_the_recorded_pick_config_choices() -> None:
    data = json.loads(GRID.read_text())
    names = [f.name for f in fields(LoraKernelConfig)]
    assert data["columns"][5:] == names
    assert len(data["rows"]) == 864
    default = load_tuning("")
    for row in data["rows"]:
        args, want = row[:5], row[5:]
        assert list(astuple(pick_config(*args, tuning=default))) == want, args
        assert list(astuple(pick_config(*args))) == want, args  # the process's (CPU: default.json)


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", ""])
def test_every_device_gets_the_tuned_values(name: str) -> None:
    """The H200's file for the H200; every other device the default file, which holds the same values
    (nothing was tuned elsewhere)."""
    expect = "h200.json" if "H200" in name else "default.json"
    assert device_file(name).name == expect
    assert load_tuning(name) == load_tuning("") == active_tuning()


def test_every_tuning_file_is_complete_and_valid() -> None:
    for path in sorted(TUNINGS_DIR.glob("*.json")):
        tuning = tuning_from_dict(json.loads(path.read_text()))
        assert tuning_from_dict(tuning_to_dict(tuning)) == tuning, path


def test_override_inline_or_file(tmp_path: Path) -> None:
    base = load_tuning("")
    inline = load_tuning("", '{"shrink_warps": [2, 2], "split_sum": "loop"}')
    assert inline == replace(base, shrink_warps=(2, 2), split_sum="loop")
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"expand_rows": []}))
    assert load_tuning("", str(f)) == replace(base, expand_rows=())
    full = json.loads(tuning_env(replace(base, meta_round=False))["LORAFLEET_LORA_TUNING"])
    assert load_tuning("", json.dumps(full)).meta_round is False


@pytest.mark.parametrize("override, match", [
    ('{"no_such": 1}', "unknown LoRA tuning fields"),
    ('{"split_sum": "twice"}', "split_sum must be one of"),
    ('{"shrink_warps": [2]}', "must be a pair"),
    ("/no/such/file.json", "LORAFLEET_LORA_TUNING"),
    ("[1, 2]", "LORAFLEET_LORA_TUNING"),
])
def test_bad_override_is_a_clear_error(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_tuning("", override)


def test_a_file_missing_fields_is_refused() -> None:
    with pytest.raises(ValueError, match="fields missing"):
        tuning_from_dict({"few_chunks": 16})


def test_pick_config_follows_the_tuning_passed() -> None:
    t: LoraTuning = replace(load_tuning(""), shrink_warps=(8, 8), num_stages=(2, 4), few_chunks=4)
    assert (pick_config(4, 3, 4096, 16, tuning=t).shrink_warps, pick_config(4, 3, 4096, 16, tuning=t).num_stages) == (8, 2)
    assert pick_config(5, 3, 4096, 16, tuning=t).num_stages == 4

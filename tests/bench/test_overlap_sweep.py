"""bench/overlap_sweep.py's variants: each is a set of settings a user has (LORAFLEET_* variables the
kernels' and the worker's settings modules read), with values those modules accept, so a variant
fails here rather than on the GPU after the model is built; and the ratio each row gets."""

from __future__ import annotations

import inspect

import pytest

from lorafleet.kernels import envs as kernel_envs
from lorafleet.kernels.lora.tuning import load_tuning
from lorafleet.worker import envs as worker_envs


@pytest.fixture
def sweep(bench_importable):
    from bench import overlap_sweep

    return overlap_sweep


def test_every_variant_sets_declared_settings_to_accepted_values(sweep, monkeypatch) -> None:
    from lorafleet.kernels.lora import linear

    declared = inspect.getsource(kernel_envs) + inspect.getsource(worker_envs)
    assert sweep.VARIANTS["defaults"] == {}
    for name, env in sweep.VARIANTS.items():
        for key, value in env.items():
            assert f'"{key}"' in declared, (name, key)
            if key == "LORAFLEET_LORA_TUNING":
                assert load_tuning("", value) != load_tuning(""), name  # changes something
        side = {"LORAFLEET_GEMM_FIRST": "GEMM_FIRST", "LORAFLEET_DELTA_STORE": "DELTA_STORE",
                "LORAFLEET_GEMM_SM_CARVEOUT": "GEMM_SM_CARVEOUT"}
        for key, attr in side.items():
            if key in env:
                monkeypatch.setattr(kernel_envs, attr, env[key])
        linear.side_path_from_env()  # parses
        monkeypatch.undo()


def test_variants_by_index_and_bad_indices(sweep, capsys) -> None:
    ap = sweep.parser()
    names = list(sweep.VARIANTS)
    assert sweep.picked(ap, "0,2") == [names[0], names[2]]
    assert sweep.picked(ap, "") == names
    with pytest.raises(SystemExit):
        sweep.picked(ap, "999")
    assert "--variants takes indices" in capsys.readouterr().err


def test_ratio_to_the_same_variants_base_only_run(sweep) -> None:
    rows = [{"variant": "a", "pass": 0, "adapters": 0, "tokens_per_s": 100.0},
            {"variant": "a", "pass": 0, "adapters": 8, "tokens_per_s": 93.0},
            {"variant": "b", "pass": 0, "adapters": 8, "tokens_per_s": 90.0}]
    assert [r["vs_base"] for r in sweep.with_ratios(rows)] == [1.0, 0.93, 0.9]

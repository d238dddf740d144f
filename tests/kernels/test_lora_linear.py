"""The GEMM SM carveout: its setting's parsing and the context that applies it."""

from __future__ import annotations

import pytest
import torch


def test_gemm_sm_carveout_setting() -> None:
    """LORAFLEET_GEMM_SM_CARVEOUT: (few, many) beside small then large GEMMs; "few,many" for both
    sizes, one number for all four; anything else is refused."""
    from lorafleet.kernels.lora.linear import _carveouts

    assert _carveouts("32,48") == (32, 48, 32, 48) and _carveouts("16") == (16,) * 4 and _carveouts("0") == (0,) * 4
    assert _carveouts("32,48,8,40") == (32, 48, 8, 40)
    for bad in ("", "x", "1,2,3", "1,2,3,4,5", "-4", "8,-1"):
        with pytest.raises(ValueError, match="LORAFLEET_GEMM_SM_CARVEOUT"):
            _carveouts(bad)


def test_gemm_sm_carveout_context_restores_the_setting() -> None:
    from lorafleet.kernels.lora.linear import gemm_sm_carveout

    before = torch._C._get_sm_carveout_experimental()
    with gemm_sm_carveout(24):
        assert torch._C._get_sm_carveout_experimental() == 24
    assert torch._C._get_sm_carveout_experimental() == before
    with gemm_sm_carveout(0):  # 0: nothing set
        assert torch._C._get_sm_carveout_experimental() == before


def test_side_path_from_the_settings(monkeypatch) -> None:
    """LORAFLEET_GEMM_FIRST / DELTA_STORE / ZERO_IN_SHRINK / LORA_FEW_CHUNKS (kernels/envs.py) make the
    side path's settings; the defaults are the tuned ones; bad values are a clear error."""
    from lorafleet.kernels import envs
    from lorafleet.kernels.lora.linear import SIDE_PATH, SidePath, side_path_from_env

    assert SIDE_PATH == SidePath(overlap_max_chunks=1 << 30, few_chunks=16, carveout=(48, 80, 48, 48),
                                 gemm_first=(True, True), zero_in_shrink=True, delta_store=(True, True))
    monkeypatch.setattr(envs, "GEMM_FIRST", "0,1")
    monkeypatch.setattr(envs, "DELTA_STORE", "0")
    monkeypatch.setattr(envs, "ZERO_IN_SHRINK", False)
    monkeypatch.setattr(envs, "LORA_FEW_CHUNKS", 0)
    got = side_path_from_env()
    assert (got.gemm_first, got.delta_store, got.zero_in_shrink, got.few_chunks) == ((False, True), (False, False), False, 0)
    for name, bad in (("GEMM_FIRST", "yes"), ("DELTA_STORE", "1,1,1")):
        monkeypatch.setattr(envs, "GEMM_FIRST", "1,1")
        monkeypatch.setattr(envs, name, bad)
        with pytest.raises(ValueError, match=f"LORAFLEET_{name}"):
            side_path_from_env()
    monkeypatch.setattr(envs, "DELTA_STORE", "1")
    monkeypatch.setattr(envs, "LORA_FEW_CHUNKS", -1)
    with pytest.raises(ValueError, match="LORAFLEET_LORA_FEW_CHUNKS"):
        side_path_from_env()

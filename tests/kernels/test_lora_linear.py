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

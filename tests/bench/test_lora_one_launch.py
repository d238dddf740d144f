"""bench/lora_one_launch.py: the one-launch kernel's two halves compute what the reference does
(under the interpreter, run as two launches: its barrier needs every program resident at once),
and the kernel with its barrier compiles for sm_90."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in the interpreter")


@pytest.fixture
def one(tmp_path, monkeypatch):
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the repo root itself would shadow the stdlib's operator
    monkeypatch.syspath_prepend(str(tmp_path))
    from bench import lora_one_launch

    return lora_one_launch


@pytest.mark.parametrize("tokens,slots,outs,programs,split_k", [(20, 7, [40, 24, 24], 3, 2), (9, 9, [72], 5, 3),
                                                                (33, 2, [24, 100], 1, 1)])
def test_two_halves_match_the_reference(one, tokens: int, slots: int, outs: list[int], programs: int,
                                        split_k: int) -> None:
    from lorafleet.kernels.lora_ops import add_lora, build_lora_meta, new_lora_b

    g = torch.Generator().manual_seed(tokens)
    d_in = 80
    ranks = [[16 if s % 3 else 8 for s in range(slots)] for _ in outs]
    ranks[0][0] = 0  # one slot leaves the first slice untargeted
    lora_a = [torch.randn(slots, 16, d_in, generator=g) / 9 for _ in outs]
    lora_b = []
    for o in outs:
        b = new_lora_b(slots, o, 16, device="cpu", dtype=torch.float32)
        b.copy_(torch.randn(slots, o, 16, generator=g) / 4)
        lora_b.append(b)
    token_slots = torch.randint(-1, slots, (tokens, 1), generator=g, dtype=torch.int32)
    meta = build_lora_meta(token_slots, torch.rand(tokens, 1, generator=g) + 0.5, slots, "cpu")
    ranks_dev = torch.tensor(ranks, dtype=torch.int32)
    x = torch.randn(tokens, d_in, generator=g)
    y = torch.randn(tokens, sum(outs), generator=g)
    ref = y.clone()
    add_lora(ref, x, lora_a, lora_b, ranks, ranks_dev, meta, backend="torch")
    part = torch.full((split_k, tokens, len(outs) * 16), float("nan"))
    sync = torch.zeros(2, dtype=torch.int32)
    one.one_launch(y, x, lora_a, lora_b, ranks_dev, meta, part, sync, programs, split_k, block_k=32, block_n=32,
                   n_per_prog=48, phases=(1, 2))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_the_barrier_compiles_for_hopper() -> None:
    from tests.kernels.hopper_compile import run_hopper_compile

    run_hopper_compile(r'''
import sys
from pathlib import Path
import tempfile
d = Path(tempfile.mkdtemp()); (d / "bench").symlink_to(Path.cwd() / "bench"); sys.path.insert(0, str(d))
from bench.lora_one_launch import _one_launch_kernel
p, i32 = "*bf16", "i32"
names = ["x_ptr", "a0_ptr", "a1_ptr", "a2_ptr", "b0_ptr", "b1_ptr", "b2_ptr", "y_ptr"]
sig = {n: p for n in names}
sig.update({n: "*i32" for n in ("ranks_ptr", "chunk_slot_ptr", "chunk_start_ptr", "chunk_end_ptr", "sorted_token_ptr")})
sig.update({"sorted_scale_ptr": "*fp32", "part_ptr": "*fp32", "sync_ptr": "*i32"})
sig.update({n: i32 for n in ("K", "K_PER_SPLIT", "N_CHUNKS", "SPLIT_K", "N_SLICES", "OUT0", "OUT1", "OUT2", "GROUPS0",
                             "GROUPS1", "GROUPS", "stride_xt", "stride_as", "stride_ar", "stride_yt", "stride_rs",
                             "stride_ps", "stride_pm")})
k = compile_(_one_launch_kernel, sig, dict(BLOCK_M=16, BLOCK_K=128, BLOCK_N=128, N_PER_PROG=256, PHASE=0, UPCAST=False))
ptx = k.asm["ptx"]
assert "atom.global" in ptx and "ld.global.cg" in ptx, "the barrier's atomics and the partials read from L2"
print("ok")
''')

"""The `@triton.jit` LoRA programs of `lorafleet.kernels.lora.programs` compile for sm_90."""

from __future__ import annotations

# Compiles both kernels for sm_90 (ptxas included) without a GPU (tests/kernels/hopper_compile.py),
# in every mode a launch picks: what the interpreter lets through (a value whose type differs
# between the branches of a constexpr `if`, an op sm_90 lacks) fails here.
HOPPER_COMPILE = r"""
import re

from lorafleet.kernels.lora import programs as tk

i32, p = "i32", "*bf16"
ptrs = {n: "*i32" for n in ("ranks_ptr", "chunk_slot_ptr", "chunk_start_ptr", "chunk_end_ptr", "sorted_token_ptr")}
shrink = {"x_ptr": p, "a0_ptr": p, "a1_ptr": p, "a2_ptr": p, **ptrs, "part_ptr": "*fp32", "zero_ptr": p,
          **{n: i32 for n in ("K", "K_PER_SPLIT", "ZERO_NUMEL", "stride_xt", "stride_as", "stride_ar", "stride_rs",
                              "stride_ps", "stride_pm")}}
expand = {"y_ptr": p, "b0_ptr": p, "b1_ptr": p, "b2_ptr": p, **ptrs, "sorted_scale_ptr": "*fp32",
          "part_ptr": "*fp32", **{n: i32 for n in ("OUT0", "OUT1", "OUT2", "GROUPS0", "GROUPS1", "SPLIT_K",
                                                   "stride_yt", "stride_rs", "stride_ps", "stride_pm")}}
# (PDL, the chunk meta in one round, the expand's split sum unrolled over 8 splits): the default on
# Hopper is the third; the others as the knobs can set them.
for pdl, meta_round, split_sum in ((False, False, 0), (True, False, 8), (True, True, 8), (True, False, 0)):
    for zero, rows in ((False, False), (True, False), (False, True), (True, True)):
        compile_(tk._lora_shrink_kernel, shrink, dict(R_MAX=16, R_PAD=16, R_BLOCKS=1, BLOCK_M=16, BLOCK_K=128, BLOCK_RANK=16,
                                   UPCAST=False, IEEE=False, PDL=pdl, ZERO=zero, ZERO_BLOCK=1024, ROWS=rows,
                                   META_ROUND=meta_round), stages=3)
    # (ATOMIC, Y_EARLY, STORE): k > 1; y read before the wait; y read after it (the shrink zeroed
    # it); the storing expand.
    for atomic, early, store in ((True, False, False), (False, True, False), (False, False, False),
                                 (False, False, True)):
        # (B rank-major, a row at a time, the tl.dot loop's loads ahead: tuning.expand_ahead)
        for rank_major, rows, ahead in ((False, False, False), (True, False, False), (False, True, False),
                                        (True, True, False), (False, False, True), (True, False, True)):
            k = compile_(tk._lora_expand_kernel, expand,
                         dict(R_MAX=16, R_PAD=16, R_BLOCK=16, B_RANK_MAJOR=rank_major, BLOCK_M=16,
                              BLOCK_N=256 if rows else 128, N_PER_PROG=256 if rows else 512, UPCAST=False,
                              IEEE=False, ATOMIC=atomic, PDL=pdl, Y_EARLY=early, STORE=store, ROWS=rows,
                              AHEAD=ahead, SPLIT_SUM=split_sum, META_ROUND=meta_round), stages=3)
            ptx = k.asm["ptx"]
            assert bool(re.search(r"\b(atom|red)\.global", ptx)) == atomic, "atomics only for k > 1"
            # PDL: every program waits for the shrink, those with nothing to do too (the kernels
            # behind the expand may take its completion for the shrink's)
            assert ptx.count("griddepcontrol.wait") >= (2 if pdl else 0) and (pdl or "griddepcontrol" not in ptx)
# The row-at-a-time modes' rank tiles follow the step's rank bound, below tl.dot's 16 too: their
# tl.dot paths sit in `else` branches, not after a `return`, where the code generator still visits
# them (this Triton refuses the expand's K below 16 there; Triton 3.3-3.4 the shrink's N too).
for r_tile in (1, 8):
    compile_(tk._lora_shrink_kernel, shrink, dict(R_MAX=64, R_PAD=16, R_BLOCKS=1, BLOCK_M=16, BLOCK_K=256,
                                                  BLOCK_RANK=r_tile, UPCAST=False, IEEE=False, PDL=True, ZERO=False,
                                                  ZERO_BLOCK=1024, ROWS=True, META_ROUND=True), stages=3)
    compile_(tk._lora_expand_kernel, expand, dict(R_MAX=64, R_PAD=16, R_BLOCK=r_tile, B_RANK_MAJOR=True, BLOCK_M=16,
                                                  BLOCK_N=512, N_PER_PROG=512, UPCAST=False, IEEE=False, ATOMIC=False,
                                                  PDL=True, Y_EARLY=True, STORE=False, ROWS=True, AHEAD=False, SPLIT_SUM=0, META_ROUND=True), warps=2, stages=3)
# The expand's sum over the K splits unrolled (lora_config.split_sum_code), in the tl.dot and
# row-at-a-time modes: 28 splits put every split's loads in the code after the wait, where the loop
# (0) has a few a trip; ptxas then issues them back to back.
for rows in (False, True):
    loads = {}
    for split_sum in (0, 28):
        k = compile_(tk._lora_expand_kernel, expand,
                     dict(R_MAX=16, R_PAD=16, R_BLOCK=16, B_RANK_MAJOR=True, BLOCK_M=16,
                          BLOCK_N=512 if rows else 128, N_PER_PROG=512 if rows else 256, UPCAST=False, IEEE=False,
                          ATOMIC=False, PDL=True, Y_EARLY=True, STORE=False, ROWS=rows, AHEAD=not rows,
                          SPLIT_SUM=split_sum, META_ROUND=True), warps=2 if rows else 4, stages=3)
        loads[split_sum] = k.asm["ptx"].split("griddepcontrol.wait", 1)[1].count("ld.global")
    assert loads[28] >= loads[0] + 24, (rows, loads)
# The row expand under a register cap (LoraKernelConfig.expand_maxnreg): ptxas is told so.
k = compile_(tk._lora_expand_kernel, expand, dict(R_MAX=16, R_PAD=16, R_BLOCK=16, B_RANK_MAJOR=True, BLOCK_M=16,
                                                  BLOCK_N=512, N_PER_PROG=512, UPCAST=False, IEEE=False, ATOMIC=False,
                                                  PDL=True, Y_EARLY=True, STORE=False, ROWS=True, AHEAD=False, SPLIT_SUM=0,
                                                  META_ROUND=True), warps=2, stages=3, maxnreg=168)
assert ".maxnreg 168" in k.asm["ptx"], "the cap reaches the PTX"
print("ok")
"""


def test_kernels_compile_for_hopper() -> None:
    """Both kernels compile to sm_90 cubins in every launch mode (no GPU needed); skipped where
    this Triton lacks the compile API."""
    from tests.kernels.hopper_compile import run_hopper_compile

    run_hopper_compile(HOPPER_COMPILE)


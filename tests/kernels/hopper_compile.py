"""Compile Triton kernels for sm_90 without a GPU, in a subprocess (the interpreter flag must be off).

A test passes the body of a script that calls `compile_(fn, signature, constexprs, ...)` (or, for
the fused row kernels, `compile_row_variants`) for its kernels and checks the PTX;
`run_hopper_compile` runs it after this preamble and expects "ok".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PREAMBLE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_(fn, sig, const, warps=4, stages=None, divisible=(), maxnreg=None):
    # Pointers, strides and the sizes named in `divisible` are marked divisible by 16, as the JIT
    # marks them at the seed shape.
    sig = {**sig, **{k: "constexpr" for k in const}}
    names = list(sig)
    div = [i for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n.startswith("stride") or n in divisible]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

def compile_row_variants(fn, sig, const, vectorised=None, **kw):
    # The fused row kernels (RMSNorm, RoPE + KV write, SiLU-mul) in each launch they get: without
    # the LoRA delta of the side stream, with it, with it defined on some rows only; plainly or with
    # PDL (kernels/pdl.py: then they wait on the device first). `vectorised`: the kernel's name, if
    # its loads must be 16 bytes wide.
    for delta, rows, pdl in ((False, False, False), (True, False, True), (True, True, False), (False, False, True)):
        k = compile_(fn, sig, dict(const, HAS_DELTA=delta, HAS_ROWS=rows, PDL=pdl), **kw)
        if vectorised:
            assert "ld.global.v4" in k.asm["ptx"], vectorised + " loads are not vectorised"
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
"""


def run_hopper_compile(body: str) -> None:
    """Run PREAMBLE + body in a fresh interpreter; skipped where this Triton lacks the compile API."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget compile API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", PREAMBLE + body], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

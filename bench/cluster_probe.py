"""Can this Triton build a LoRA shrink split over a thread-block cluster's CTAs? (no GPU needed)

    python -m bench.cluster_probe [--out bench/results/cluster-probe.json]

The LoRA pair misses issue 3's small-op target (`lora <= 1.3 * floor + 3 us`) by its two dependent
launches: one launch that only moves the same bytes meets it (docs/benchmarks.md, "Against the
targets"). One launch needs the shrink's sum over K to finish across CTAs before the expand reads
it. A grid barrier and per-chunk flags in global memory were measured slower than two launches;
a Hopper cluster (CTAs sharing a hardware barrier and each other's shared memory) is the design
left, and Triton reaches it through `num_ctas` (a program split over a cluster's CTAs).

This compiles the shrink's core, h[r] = sum_k x[k] * A[r, k] for one token, for sm_90 at
num_ctas 1, 2, 4, 8, in the two ways Triton can be handed the [R, K] tile, and reports for each:
whether it compiles, whether the PTX has a cluster barrier, and which axes of the A tile Triton's
layout spreads over the cluster's CTAs (R: each CTA reads its rows of A and all of x, and h is
gathered across the cluster; K: its columns of both, and h is summed across it; either spreads the
adapter's bytes). It compiles ahead of time for a named target, so it needs no GPU, and it uses the
Triton of the machine it runs on: run it where the kernels will run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

import triton
import triton.language as tl

K = 4096  # hidden size of the seed shape: the qkv / gate_up shrink's K
R = 16


@triton.jit
def _shrink_rk(x_ptr, a_ptr, h_ptr, K: tl.constexpr, R: tl.constexpr):
    """A as the slot pool stores it, [R, K] unit stride in K; sum over axis 1."""
    offs_k = tl.arange(0, K)
    offs_r = tl.arange(0, R)
    x = tl.load(x_ptr + offs_k).to(tl.float32)
    a = tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :]).to(tl.float32)
    tl.store(h_ptr + offs_r, tl.sum(a * x[None, :], axis=1))


@triton.jit
def _shrink_kr(x_ptr, a_ptr, h_ptr, K: tl.constexpr, R: tl.constexpr):
    """The same product with K as the tile's first axis (in case the layout splits the first axis)."""
    offs_k = tl.arange(0, K)
    offs_r = tl.arange(0, R)
    x = tl.load(x_ptr + offs_k).to(tl.float32)
    a = tl.load(a_ptr + offs_k[:, None] + offs_r[None, :] * K).to(tl.float32)
    tl.store(h_ptr + offs_r, tl.sum(a * x[:, None], axis=0))


# form -> (kernel, its A tile's axis names)
FORMS = {"[R, K], sum axis 1": (_shrink_rk, "RK"), "[K, R], sum axis 0": (_shrink_kr, "KR")}

_REDUCE = re.compile(r'"tt\.reduce"\(%[\w.]+\) <\{axis = (\d+) : i32\}>.*?\}\) : \(tensor<[^,>]*, (#\w+)>\)', re.S)


def reduced_layout(ttgir: str) -> tuple[int, str] | None:
    """(axis, layout name) of the first tt.reduce in a TTGIR module, or None."""
    m = _REDUCE.search(ttgir)
    return (int(m.group(1)), m.group(2)) if m else None


def split_axes(ttgir: str, layout: str) -> list[int]:
    """The axes that `layout`'s definition spreads over the cluster's CTAs.

    Two spellings: `CTASplitNum = [..]` (CTAs along each axis; Triton 3.6 and earlier), and
    `CGALayout = [[..], ..]` (a basis a CTA-id bit, each an offset along every axis; later ones).
    """
    m = re.search(rf"^{re.escape(layout)} = .*$", ttgir, re.M)
    if m is None:
        raise ValueError(f"no definition of {layout} in the module")
    line = m.group(0)
    split = re.search(r"CTASplitNum = \[([\d, ]+)\]", line)
    if split:
        return [axis for axis, n in enumerate(split.group(1).split(",")) if int(n) > 1]
    cga = re.search(r"CGALayout = (\[\[.*?\]\])", line)
    if cga:
        bases = json.loads(cga.group(1))
        return [axis for axis in range(len(bases[0])) if any(b[axis] != 0 for b in bases)]
    return []  # no CTA fields: one CTA


@contextlib.contextmanager
def _stderr_into(lines: list[str]):
    """The compiler's C++ side prints a failing module's whole IR to fd 2: keep it off the table,
    and hand back what it printed (its first `error:` line says why)."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().splitlines())


def probe(num_ctas: int, form: str, arch: int = 90) -> dict:
    from triton.backends.compiler import GPUTarget
    fn, axes = FORMS[form]
    sig = {"x_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*fp32", "K": "constexpr", "R": "constexpr"}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={"K": K, "R": R})
    row = {"triton": triton.__version__, "form": form, "num_ctas": num_ctas}
    printed: list[str] = []
    try:
        with _stderr_into(printed):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_ctas": num_ctas, "num_warps": 4})
    except Exception as exc:  # the compiler's own failure is the finding
        why = next((ln.split("error:", 1)[1] for ln in printed if "error:" in ln), str(exc))
        return row | {"compiles": False, "error": f"{type(exc).__name__}: {why.strip()[:300]}"}
    found = reduced_layout(compiled.asm["ttgir"])
    return row | {
        "compiles": True,
        "cluster_barrier": "barrier.cluster" in compiled.asm["ptx"],
        "a_axes_over_ctas": "".join(axes[a] for a in split_axes(compiled.asm["ttgir"], found[1])) if found else "?",
    }


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("cluster_probe compiles for the GPU: run it without TRITON_INTERPRET=1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--num-ctas", default="1,2,4,8")
    args = ap.parse_args()
    rows = [probe(n, form) for form in FORMS for n in (int(v) for v in args.num_ctas.split(","))]
    print(f"Triton {triton.__version__}, target sm_90, K={K}, R={R}")
    print(f"{'form':20s} {'ctas':>4s}  {'compiles':8s} {'cluster barrier':15s} {'A over CTAs':11s}  error")
    for r in rows:
        print(f"{r['form']:20s} {r['num_ctas']:4d}  {str(r['compiles']):8s} {str(r.get('cluster_barrier', '')):15s} "
              f"{r.get('a_axes_over_ctas', '') or '-':11s}  {r.get('error', '')}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

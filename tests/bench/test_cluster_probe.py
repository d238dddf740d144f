"""bench/cluster_probe.py: reading the CTA split out of a layout (both of Triton's spellings), and
the probe against this machine's own Triton for one CTA, where nothing may be split."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "definition,axes",
    [
        # Triton 3.9's spelling: a basis per CTA-id bit, each an offset along every axis.
        ("#blocked = #ttg.blocked<{sizePerThread = [1, 1], order = [1, 0], CGALayout = [[1, 0], [2, 0]]}>", [0]),
        ("#blocked = #ttg.blocked<{sizePerThread = [1, 1], order = [0, 1], CGALayout = [[0, 1], [0, 2], [0, 4]]}>", [1]),
        ("#blocked = #ttg.blocked<{sizePerThread = [1, 1], order = [0, 1], CGALayout = [[0, 1], [1, 0]]}>", [0, 1]),
        ("#blocked = #ttg.blocked<{sizePerThread = [1], order = [0], CGALayout = [[0], [0]]}>", []),
        # The older spelling: CTAs along each axis.
        ("#blocked = #triton_gpu.blocked<{sizePerThread = [1, 1], CTAsPerCGA = [1, 4], CTASplitNum = [1, 4], CTAOrder = [1, 0]}>", [1]),
        ("#blocked = #triton_gpu.blocked<{sizePerThread = [1, 1], CTAsPerCGA = [2, 1], CTASplitNum = [1, 1], CTAOrder = [1, 0]}>", []),
        ("#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], order = [1, 0]}>", []),
    ],
)
def test_split_axes_reads_either_spelling(bench_importable, definition: str, axes: list[int]) -> None:
    from bench.cluster_probe import split_axes

    module = f"#other = #ttg.blocked<{{CGALayout = [[1, 1]]}}>\n{definition}\nmodule {{}}"
    assert split_axes(module, "#blocked") == axes


def test_split_axes_refuses_an_unknown_layout(bench_importable) -> None:
    from bench.cluster_probe import split_axes

    with pytest.raises(ValueError, match="#blocked2"):
        split_axes("#blocked = #ttg.blocked<{}>\n", "#blocked2")


def test_reduced_layout_finds_the_operand_of_the_reduce(bench_importable) -> None:
    from bench.cluster_probe import reduced_layout

    ttgir = """
    %23 = arith.mulf %18, %22 : tensor<16x4096xf32, #blocked>
    %24 = "tt.reduce"(%23) <{axis = 1 : i32}> ({
    ^bb0(%arg3: f32, %arg4: f32):
      %26 = arith.addf %arg3, %arg4 : f32
      tt.reduce.return %26 : f32
    }) : (tensor<16x4096xf32, #blocked3>) -> tensor<16xf32, #ttg.slice<{dim = 1, parent = #blocked3}>>
    """
    assert reduced_layout(ttgir) == (1, "#blocked3")
    assert reduced_layout("tt.func {}") is None


def test_one_cta_compiles_and_splits_nothing(bench_importable, tmp_path) -> None:
    """The script with this machine's Triton, for sm_90 (no GPU needed; a process of its own, since
    the suite's TRITON_INTERPRET=1 makes kernels interpreted): one CTA has nothing to split or sync."""
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # where bench_importable linked the bench folder
    done = subprocess.run([sys.executable, "-m", "bench.cluster_probe", "--num-ctas", "1", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["form"] for r in rows] == ["[R, K], sum axis 1", "[K, R], sum axis 0"]
    for row in rows:
        assert row["compiles"], row
        assert row["num_ctas"] == 1
        assert row["cluster_barrier"] is False
        assert row["a_axes_over_ctas"] == ""
    assert "sum axis 1      1  True" in done.stdout

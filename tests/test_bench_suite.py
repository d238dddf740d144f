"""bench/ is a maintained suite: every script named in docs/benchmarks.md, at most 40 result files, the
result files the docs cite present, every benchmark reachable from `python -m bench`, and no
benchmark setting the configuration by assigning a lorafleet module's globals (it sets the public
settings, or passes config objects)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
MAX_RESULTS = 40


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_every_bench_script_is_named_in_the_docs() -> None:
    doc = DOC.read_text()
    missing = [p.stem for p in scripts() if not re.search(rf"`{re.escape(p.stem)}(\.py)?`|bench/{p.stem}\.py|bench\.{p.stem}\b", doc)]
    assert not missing, f"bench scripts docs/benchmarks.md does not name (as `name`): {missing}"


def test_bench_results_hold_at_most_40_files() -> None:
    files = [p for p in (BENCH / "results").rglob("*") if p.is_file()]
    assert len(files) <= MAX_RESULTS, f"{len(files)} files in bench/results (at most {MAX_RESULTS}: keep those the docs cite)"


def test_result_files_the_docs_cite_exist() -> None:
    """A file named bare or as bench/results/NAME exists; one pinned to a commit (`abc1234:bench/results/NAME`)
    is history and need not."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    pattern = re.compile(r"(?<![\w.:/-])(?:bench/results/)?([\w.-]+\.(?:json|csv))(?![\w.-])")
    cited = set()
    for m in pattern.finditer(text):
        before = text[max(0, m.start() - 60):m.start()]
        if re.search(r"[0-9a-f]{7,40}:bench/results/$", before) or "*" in m.group(1):
            continue
        if m.group(0).startswith("bench/results/") or (BENCH / "results" / m.group(1)).exists():
            cited.add(m.group(1))
    absent = sorted(n for n in cited if not (BENCH / "results" / n).exists())
    assert not absent, f"docs cite bench/results files that are gone (pin them to a commit): {absent}"


def _lorafleet_modules(tree: ast.Module) -> set[str]:
    """Local names bound to lorafleet modules (or to names imported from them) in a script."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("lorafleet"):
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lorafleet"):
            names |= {a.asname or a.name for a in node.names}
    return names


def global_assignments(source: str) -> list[str]:
    """`module.NAME = ...` (plain, augmented or annotated; also through `a.b.NAME`), `setattr(module, ...)`
    and `monkeypatch`-free `module.__dict__[...] = ...` where module is a lorafleet import."""
    tree = ast.parse(source)
    mods = _lorafleet_modules(tree)

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and root(t) in mods:
                found.append(f"line {t.lineno}: {ast.unparse(t)} = ...")
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "__dict__" \
                    and root(t.value) in mods:
                found.append(f"line {t.lineno}: {ast.unparse(t)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            if root(node.args[0]) in mods:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_bench_script_assigns_a_lorafleet_modules_globals() -> None:
    bad = {p.name: hits for p in sorted(BENCH.glob("*.py")) if (hits := global_assignments(p.read_text()))}
    assert not bad, f"bench scripts patch lorafleet modules (set LORAFLEET_* settings or pass a config): {bad}"


@pytest.mark.parametrize("source, hits", [
    ("from lorafleet.kernels.lora import linear as ll\nll.DELTA_STORE = (1, 1)\n", 1),
    ("import lorafleet.kernels.lora.config\nlorafleet.kernels.lora.config.SHRINK_ROWS = ()\n", 1),
    ("from lorafleet.worker.sampling import sampler\nsetattr(sampler, 'CUDA_DRAW', 'torch')\n", 1),
    ("from lorafleet.kernels.sampling import draw_triton as dt\ndt.BLOCK, x = 1, 2\n", 1),
    ("from lorafleet.worker.models.llama import LlamaModel\nLlamaModel._linear_deferred = None\n", 1),
    ("from lorafleet.kernels.lora import config\nconfig.__dict__['NUM_STAGES'] = (2, 2)\n", 1),
    ("import torch\ntorch.backends.cudnn.enabled = False\n", 0),  # not lorafleet
    ("from lorafleet.kernels.lora.linear import SIDE_PATH\nx = SIDE_PATH.carveout\n", 0),
    ("def f(engine):\n    engine.async_steps.defer_sampling = True\n", 0),  # an object's field, not a module
])
def test_the_check_finds_module_assignments(source: str, hits: int) -> None:
    assert len(global_assignments(source)) == hits


def test_the_entry_point_lists_and_runs_the_suite(tmp_path) -> None:
    """`python -m bench` lists every benchmark (a module with a __main__ block) with a line; `python -m
    bench NAME --help` reaches the script; an unknown name is a usage error naming the suite."""
    (tmp_path / "bench").symlink_to(BENCH)  # the repo root itself on sys.path would shadow the stdlib's operator
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # found under PYTHONSAFEPATH=1 too
    env.pop("TRITON_INTERPRET", None)  # cluster_probe compiles for the GPU and refuses the interpreter

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bench", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)

    listed = run()
    assert listed.returncode == 0, listed.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        from bench.__main__ import benchmarks
    finally:
        sys.path.remove(str(tmp_path))
    suite = benchmarks()
    assert {"engine", "kernels", "overlap_sweep", "knob_ab", "fleet_sim"} <= set(suite)
    assert "variants" not in suite and "kernel_cases" not in suite  # shared modules, no __main__
    for name, line in suite.items():
        assert re.search(rf"^  {name} +\S", listed.stdout, re.M), name
        assert line, f"bench/{name}.py has no docstring line"
    helped = run("cluster_probe", "--help")
    assert helped.returncode == 0 and "usage" in helped.stdout.lower(), helped.stderr
    unknown = run("no_such_bench")
    assert unknown.returncode == 2 and "overlap_sweep" in unknown.stderr

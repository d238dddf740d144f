"""The benchmark suite's entry point: `python -m bench NAME [args]` runs bench/NAME.py as
`python -m bench.NAME [args]` would; `python -m bench` lists the benchmarks, one line each.

A benchmark is any module of this folder with a `__main__` block; the line shown is the first line of
its docstring. New scripts join by being added to the folder (and named in docs/benchmarks.md).
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [node.test.left, *node.test.comparators]
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
        isinstance(n, ast.Constant) and n.value == "__main__" for n in names)


def benchmarks(folder: Path = HERE) -> dict[str, str]:
    """name -> the first line of its docstring, for every runnable module of `folder`, by name."""
    out = {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        if any(_is_main_guard(node) for node in tree.body):
            doc = ast.get_docstring(tree) or ""
            out[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, found))
        print("usage: python -m bench NAME [args]   (python -m bench NAME --help: its options)\n")
        for name, line in found.items():
            print(f"  {name:<{width}}  {line}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"no benchmark {name!r}; the suite: {', '.join(found)}", file=sys.stderr)
        return 2
    sys.argv = [f"bench/{name}.py", *rest]
    try:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

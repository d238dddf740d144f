"""The maintained benchmark suite (`python -m bench` lists it)."""

import sys
from pathlib import Path


def _root_last_on_path() -> None:
    """`python -m bench…` from the repository root puts the root first on sys.path, where its folders
    kernels/ and operator/ shadow installed packages of those names (transformers imports the Hub's
    `kernels` package). The project is imported as lorafleet.*; the root stays on the path, last, for
    the scripts that reuse test helpers (`tests.operator…`)."""
    root = Path(__file__).resolve().parent.parent
    entries = [p for p in sys.path if Path(p or ".").resolve() == root]
    if entries:
        sys.path[:] = [p for p in sys.path if p not in entries] + [str(root)]


_root_last_on_path()

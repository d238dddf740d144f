"""Type-check the pure cores listed in pyproject.toml's [tool.mypy] `files` (CI: `python tests/mypy_check.py`).

The import root `lorafleet` is mapped onto the repository's top-level folders (setup.py), which mypy
cannot follow through an editable install. So this builds a tree of links under a temporary
directory, `lorafleet/` = common/'s entries + worker/ router/ operator/ kernels/, maps each listed
path into it and runs mypy there with the rest of the [tool.mypy] settings. Extra arguments go to
mypy. Exits with mypy's status.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"worker": "worker", "router": "router", "operator": "operator", "kernels": "kernels"}


def link_tree(dest: Path, root: Path = ROOT) -> Path:
    """dest/lorafleet: common/'s entries and the component folders, as links; returns dest."""
    pkg = dest / "lorafleet"
    pkg.mkdir()
    for entry in (root / "common").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in FOLDERS.items():
        (pkg / name).symlink_to(root / folder)
    return dest


def tree_path(repo_path: str, tree: Path) -> Path:
    """A listed repository path (common/protocol.py, router/scheduling/) as a path in the tree."""
    parts = Path(repo_path).parts
    if parts[0] == "common":
        return tree / "lorafleet" / Path(*parts[1:])
    if parts[0] in FOLDERS:
        return tree / "lorafleet" / Path(*parts)
    raise ValueError(f"{repo_path}: not under common/ or a component folder")


def main(argv: list[str]) -> int:
    from mypy import api

    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    with tempfile.TemporaryDirectory() as tmp:
        tree = link_tree(Path(tmp))
        paths = [str(tree_path(f, tree)) for f in files]
        out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(Path(tmp) / ".cache"),
                                    *argv, *paths])
        print(out.replace(str(tree) + "/lorafleet/", "lorafleet/"), end="")
        print(err, end="", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

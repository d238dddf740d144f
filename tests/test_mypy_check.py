"""tests/mypy_check.py (CI's type check): every file pyproject.toml lists exists, and each maps onto
the `lorafleet` module the package layout gives it (setup.py), through the link tree mypy reads."""

from __future__ import annotations

from pathlib import Path

import tomllib

from tests.mypy_check import ROOT, link_tree, tree_path


def test_listed_files_exist_and_map_onto_their_modules(tmp_path: Path) -> None:
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert {"router/scheduling/", "common/protocol.py", "kernels/lora/tuning.py", "worker/envs.py"} <= set(files)
    tree = link_tree(tmp_path)
    for f in files:
        assert (ROOT / f).exists(), f
        mapped = tree_path(f, tree)
        assert mapped.exists() and mapped.resolve() == (ROOT / f).resolve(), f
    assert tree_path("common/protocol.py", tree) == tmp_path / "lorafleet" / "protocol.py"
    assert (tmp_path / "lorafleet" / "router" / "scheduling").is_dir()

"""Admin tokens: per pool from a folder, one file, or a fixed value; re-read when files change."""

from __future__ import annotations

import os
from pathlib import Path

from lorafleet.router.admin_tokens import AdminTokens


def write(path: Path, text: str) -> None:
    """Like a Secret volume update: a new file swapped in (new inode), not an in-place edit."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_precedence_dir_then_file_then_static(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    write(d / "pool-a", "token-a\n")
    write(tmp_path / "token", "token-all")
    tokens = AdminTokens(tmp_path / "token", d, "static")
    table = [("pool-a", "token-a"), ("pool-b", "token-all"), (None, "token-all")]
    for pool, expected in table:
        assert tokens.for_pool(pool) == expected, pool
    assert AdminTokens(None, d, "static").for_pool("pool-b") == "static"
    assert AdminTokens(None, d).for_pool("pool-b") is None
    assert AdminTokens().headers("p") == {}
    assert AdminTokens(static="s").headers("p") == {"Authorization": "Bearer s"}


def test_pool_names_cannot_escape_the_folder(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    write(tmp_path / "secret", "outside")
    tokens = AdminTokens(None, d)
    assert tokens.for_pool("../secret") is None and tokens.for_pool("..") is None


def test_rotation_is_picked_up(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    write(d / "p", "old")
    write(tmp_path / "token", "old-all")
    tokens = AdminTokens(tmp_path / "token", d)
    assert tokens.for_pool("p") == "old" and tokens.for_pool(None) == "old-all"
    write(d / "p", "new")
    write(tmp_path / "token", "new-all")
    assert tokens.for_pool("p") == "new" and tokens.for_pool(None) == "new-all"
    (d / "p").unlink()  # the pool's Secret went away: fall back to the shared file
    assert tokens.for_pool("p") == "new-all"


def test_kubernetes_secret_volume_layout(tmp_path):
    """Files are symlinks into a `..data` folder that the kubelet swaps atomically."""
    d = tmp_path / "tokens"
    d.mkdir()
    (d / "..v1").mkdir()
    (d / "..v1" / "p").write_text("v1")
    (d / "..data").symlink_to("..v1")
    (d / "p").symlink_to("..data/p")
    tokens = AdminTokens(None, d)
    assert tokens.for_pool("p") == "v1"
    (d / "..v2").mkdir()
    (d / "..v2" / "p").write_text("v2")
    (d / "..data_tmp").symlink_to("..v2")
    os.replace(d / "..data_tmp", d / "..data")
    assert tokens.for_pool("p") == "v2"

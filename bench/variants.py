"""In-engine A/B runs: one process a variant, its settings in the environment (the LORAFLEET_*
variables a user sets, read at start-up), never patched into modules.

A benchmark with variants runs itself as a child per variant (`run_child`): the child is given
`--rows-to FILE`, runs its cases in-process and writes its rows there as JSON; the parent gathers
them and prints the comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path


def child_env(settings: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a variant's process: `base` (default: this process's) with `settings` over it."""
    env = dict(os.environ if base is None else base)
    env.update(settings)
    return env


def run_child(module: str, settings: Mapping[str, str], argv: Sequence[str]) -> list[dict]:
    """`python -m module *argv --rows-to FILE` with `settings` in its environment -> the rows it wrote.
    Its output goes to this process's; a failing child raises CalledProcessError."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_to = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, "-m", module, *argv, "--rows-to", str(rows_to)],
                       env=child_env(settings), check=True)
        return json.loads(rows_to.read_text())

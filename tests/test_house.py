"""The layout's rules, checked on the source tree (docs/architecture.md): no import cycles among
`lorafleet` modules, dependencies pointing one way, no module over 450 lines, the environment read
in one module per component, no history narrated in code, a maintained benchmark suite."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"common": "lorafleet", "worker": "lorafleet.worker", "router": "lorafleet.router",
            "operator": "lorafleet.operator", "kernels": "lorafleet.kernels"}
MAX_LINES = 450
# One module per component reads the environment (the CLI entries may read their own).
ENV_READERS = {"lorafleet.worker.envs", "lorafleet.kernels.envs", "lorafleet.local.options",
               "lorafleet.local.workers", "lorafleet.operator.cli", "lorafleet.router.settings"}
HISTORY = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth|twenty\w*|"
    r"thirty\w*)[- ]session\b|\bsession (of|on) 20\d\d|\bsessions? \d+\b|\bearlier (attempt|version|session)s?\b"
    r"|\b(was|were) (tried|measured) (before|earlier)\b", re.I)


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """The lorafleet modules `name` imports, anywhere in the file (TYPE_CHECKING and lazy imports too)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    out = set()
    for f in found:
        while f and f not in MODULES:
            f = f.rsplit(".", 1)[0] if "." in f else ""
        if f and f != name and MODULES[f].name != "__init__.py":
            out.add(f)
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def test_no_import_cycles() -> None:
    assert strongly_connected(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize(("importer", "forbidden"), [
    ("lorafleet.router", "lorafleet.worker"),
    ("lorafleet.router", "lorafleet.operator"),
    ("lorafleet.operator", "lorafleet.worker"),
    ("lorafleet.operator", "lorafleet.router"),
    ("lorafleet.worker.engine", "lorafleet.worker.server"),
    ("lorafleet.worker.engine", "lorafleet.worker.openai"),
    ("lorafleet.worker.models", "lorafleet.worker.engine"),
    ("lorafleet.worker.lora", "lorafleet.worker.server"),
    ("lorafleet.kernels", "lorafleet.worker"),
])
def test_dependencies_point_one_way(importer: str, forbidden: str) -> None:
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m.startswith(importer + ".")
                 for d in deps if d.startswith(forbidden + "."))
    assert bad == []


def test_modules_stay_small() -> None:
    big = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_environment_read_in_one_module_per_component() -> None:
    readers = set()
    for name, path in MODULES.items():
        text = path.read_text()
        if re.search(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(", text):
            readers.add(name)
    assert readers <= ENV_READERS, sorted(readers - ENV_READERS)


def test_no_history_narrated_in_code() -> None:
    lines = []
    for name, path in MODULES.items():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                lines.append(f"{name}:{i}: {line.strip()}")
    assert lines == []


def test_history_pattern_catches_narration() -> None:
    assert HISTORY.search("# measured in the nineteenth session")
    assert HISTORY.search("an earlier attempt found it slower")
    assert not HISTORY.search("# the session's token is re-read when the file changes")

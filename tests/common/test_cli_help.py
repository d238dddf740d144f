"""Every `lorafleet` command's `--help`: each flag explained with its default, flags grouped by
topic, and the environment variables the command's code reads named in the epilog."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from lorafleet.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
# Where each command's code lives (recursive globs: modules move between subpackages).
SOURCES = {
    "worker": ["worker/**/*.py", "kernels/**/*.py"],
    "generate": ["worker/**/*.py", "kernels/**/*.py"],
    "router": ["router/**/*.py", "common/placement_store.py", "common/breaker.py", "common/connection_guard.py"],
    "operator": ["operator/**/*.py"],
    "up": ["common/local/**/*.py", "worker/**/*.py", "kernels/**/*.py"],
    "adapters": ["common/local/adapters_cli.py", "common/local/run_dir.py", "common/local/manifests.py"],
    "demo-assets": ["worker/**/demo_assets.py"],
}
ENV_READ = re.compile(r"""(?:environ(?:\.get)?\(\s*|environ\[\s*|getenv\(\s*)["']([A-Z][A-Z0-9_]+)["']""")


def parsers(name: str, parser: argparse.ArgumentParser):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from parsers(f"{name} {sub}", subparser)


def all_parsers():
    for command, (module_name, _) in COMMANDS.items():
        module = importlib.import_module(module_name)
        yield from parsers(command, module.build_parser())


PARSERS = dict(all_parsers())


def rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return formatter.format_help()


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_flag_has_help_with_its_default(name: str) -> None:
    parser = PARSERS[name]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{name} {flag}: no help text"
        if action.option_strings and not action.required:
            assert "default" in rendered(parser, action).lower(), f"{name} {flag}: no default shown"


@pytest.mark.parametrize("name", list(PARSERS))
def test_flags_are_grouped_by_topic(name: str) -> None:
    parser = PARSERS[name]
    untitled = [a.option_strings[0] for a in parser._optionals._group_actions
                if not isinstance(a, argparse._HelpAction)]
    assert not untitled, f"{name}: flags outside a topic group: {untitled}"
    titled = [g for g in parser._action_groups if g not in (parser._optionals, parser._positionals)]
    assert titled and all(g._group_actions for g in titled)
    help_text = parser.format_help()
    for group in titled:
        assert f"\n{group.title}:\n" in help_text


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_names_the_environment_variables_read(command: str) -> None:
    read: set[str] = set()
    for pattern in SOURCES[command]:
        for path in REPO.glob(pattern):
            read |= set(ENV_READ.findall(path.read_text()))
    epilog = PARSERS[command].format_help().split("environment variables", 1)
    assert len(epilog) == 2, f"{command}: --help says nothing of environment variables"
    missing = sorted(v for v in read if v not in epilog[1])
    assert not missing, f"{command} reads {missing} but its --help does not name them"

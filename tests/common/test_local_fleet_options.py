"""`lorafleet up`'s options are checked before anything starts; a worker's start-up failure is
reported with its own log lines, not an earlier run's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorafleet.local import process_group
from lorafleet.local.options import build_parser, options_from_args
from lorafleet.local.preflight import FleetError


def options(*argv: str):
    return options_from_args(build_parser().parse_args(list(argv)))


def test_defaults_pass() -> None:
    opts = options()
    assert (opts.port, opts.workers, opts.max_loras, opts.max_lora_rank) == (8000, 2, 8, 64)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--port", "99999"], "--port 99999: a port is 1..65535"),
    (["--port", "0"], "--port 0: a port is 1..65535"),
    (["--worker-port", "70000"], "--worker-port 70000: a port is 1..65535"),
    (["--worker-port", "65535", "--workers", "3"], "3 workers need ports up to 65537, past 65535"),
    (["--ready-timeout", "0"], "--ready-timeout 0: must be more than 0 seconds"),
    (["--max-loras", "0"], "max-loras must be >= 1 (--max-loras 0,"),
    (["--max-lora-rank", "1024"], "max-lora-rank must be in 1..512 (--max-loras 8, --max-cpu-loras 32, --max-lora-rank 1024)"),
    # The default --max-cpu-loras (32) is named with its value, not blamed as if given.
    (["--max-loras", "100"], "max-cpu-loras must be >= max-loras (--max-loras 100, --max-cpu-loras 32,"),
])
def test_bad_options_are_refused_before_starting(argv: list[str], message: str) -> None:
    with pytest.raises(FleetError) as info:
        options(*argv)
    assert message in str(info.value)


def test_a_childs_log_tail_is_its_own(tmp_path: Path) -> None:
    log = tmp_path / "worker-0.log"
    for line in ("first run: max_loras must be >= 1", "second run: max_lora_rank must be in 1..512"):
        child = process_group.spawn("w", [sys.executable, "-c", f"print({line!r})"], log)
        assert child.process.wait(timeout=60) == 0
    assert child.log_tail() == "second run: max_lora_rank must be in 1..512"
    assert "first run" in log.read_text()  # the log itself keeps every run

"""One `lorafleet up` per run directory: a second is refused before it touches the first's files,
naming the running fleet; a lock left by a dead process is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafleet.local.fleet_lock import LOCK_NAME, FleetLock, FleetLocked
from lorafleet.local.run_dir import FleetState, RunDir
from tests.common.test_local_fleet import free_port, lorafleet_cmd, start_fleet, stop_fleet

HOLD = """
import sys, time
from pathlib import Path
from lorafleet.local.fleet_lock import FleetLock
FleetLock.acquire(Path(sys.argv[1]), "127.0.0.1", int(sys.argv[2]))
print("locked", flush=True)
time.sleep(600)
"""


def hold_lock(root: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root), str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def fleet_files(rd: RunDir) -> dict[str, bytes]:
    return {str(p.relative_to(rd.root)): p.read_bytes() for p in sorted(rd.root.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def test_second_up_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / ".lorafleet")
    rd.create()
    rd.write_state(FleetState(pid=1, router_url="http://127.0.0.1:8123", model="m", pool="local", device="cpu",
                              store="embedded", adapter_root=str(rd.adapters), workers=()))
    rd.write_desired("sql", {"pool": "local", "source": "sql"}, 3)
    rd.new_token()
    before = fleet_files(rd)
    holder = hold_lock(rd.root, 8123)
    try:
        started = time.monotonic()
        result = subprocess.run([*lorafleet_cmd(), "up", "--port", str(free_port()), "--no-redis",
                                 "--assets", str(tmp_path / "assets")],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        assert "already running" in result.stderr
        assert f"pid {holder.pid}" in result.stderr and "127.0.0.1:8123" in result.stderr
        assert fleet_files(rd) == before  # state, specs and token of the running fleet untouched
        assert not (tmp_path / "assets").exists()  # refused before anything was made
        assert time.monotonic() - started < 60
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holders_lock_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / ".lorafleet"
    holder = hold_lock(root, 8123)
    with pytest.raises(FleetLocked, match=f"pid {holder.pid}"):
        FleetLock.acquire(root, "127.0.0.1", 9000)
    holder.send_signal(signal.SIGKILL)  # no chance to clean up
    holder.wait()
    assert json.loads((root / LOCK_NAME).read_text())["pid"] == holder.pid  # the stale lock is still there
    lock = FleetLock.acquire(root, "127.0.0.1", 9000)
    try:
        assert lock.holder()["pid"] == os.getpid() and lock.holder()["port"] == 9000
        assert any("taking over" in r.message for r in caplog.records)
    finally:
        lock.release()
    FleetLock.acquire(root, "127.0.0.1", 9001).release()  # released: free again


def test_the_lock_is_not_inherited_by_children(tmp_path: Path) -> None:
    """Workers are children of `up`: were the lock's file inherited, a worker outliving `up` would
    keep the run directory locked."""
    root = tmp_path / ".lorafleet"
    lock = FleetLock.acquire(root, "127.0.0.1", 9000)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.release()
        FleetLock.acquire(root, "127.0.0.1", 9001).release()
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_second_up_leaves_a_running_fleet_serving(tmp_path: Path, demo_assets: Path) -> None:
    import httpx

    fleet = start_fleet(tmp_path, free_port(), demo_assets, "--no-redis")
    try:
        before = fleet_files(RunDir(fleet.run_dir))
        result = subprocess.run([*lorafleet_cmd(), "up", "--port", str(free_port()), "--no-redis",
                                 "--assets", str(demo_assets)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1 and f"pid {fleet.process.pid}" in result.stderr, result.stderr
        after = fleet_files(RunDir(fleet.run_dir))
        assert {k: v for k, v in after.items() if not k.startswith("logs/")} == \
               {k: v for k, v in before.items() if not k.startswith("logs/")}
        r = httpx.post(fleet.url + "/v1/completions", json={"model": "sql", "prompt": "SELECT", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert fleet.adapters("get").returncode == 0
    finally:
        assert stop_fleet(fleet) == 0

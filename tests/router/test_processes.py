"""`lorafleet router --processes N`: N processes on one port (SO_REUSEPORT), stopped together."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from lorafleet.router.cli import main
from lorafleet.router.processes import reuseport_socket
from tests.router.fake_worker import free_port, wait_http

ROOT = Path(__file__).resolve().parents[2]


def test_processes_must_be_positive(capsys):
    assert main(["--worker", "http://a:1", "--processes", "0"]) == 2
    assert "--processes" in capsys.readouterr().err


def test_reuseport_sockets_share_a_port():
    port = free_port()
    a = reuseport_socket("127.0.0.1", port)
    b = reuseport_socket("127.0.0.1", port)
    try:
        assert a.getsockname() == b.getsockname()
    finally:
        a.close()
        b.close()
    with socket.socket() as plain:  # a socket without SO_REUSEPORT still cannot take it while one listens
        c = reuseport_socket("127.0.0.1", port)
        try:
            try:
                plain.bind(("127.0.0.1", port))
                taken = False
            except OSError:
                taken = True
        finally:
            c.close()
    assert taken


def test_two_router_processes_serve_one_port_and_stop_together():
    up, port = free_port(), free_port()
    fake = subprocess.Popen([sys.executable, str(ROOT / "bench" / "fake_stream.py"), "--port", str(up)])
    router = subprocess.Popen([sys.executable, "-m", "lorafleet", "router", "--port", str(port), "--processes", "2",
                               "--worker", f"http://127.0.0.1:{up}", "--lora-modules", "a=/a",
                               "--log-level", "warning"], cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{up}/health")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both processes polled the worker: /ready from either
            try:
                if all(httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200 for _ in range(6)):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        servers = [p for p in psutil.Process(router.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(servers) == 2
        for _ in range(10):  # a new connection each: the kernel picks a process each time
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-lorafleet-replica"] == f"127.0.0.1:{up}"
        router.terminate()
        assert router.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(servers, timeout=10)
        assert not alive
    finally:
        for proc in (router, fake):
            if proc.poll() is None:
                proc.kill()

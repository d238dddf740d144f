"""The router's streaming data path: CPU per relayed token and per request, burst TTFT, several processes.

Setup, all on loopback: `bench/fake_stream.py` (a raw-asyncio fake worker streaming one token every
`--interval-ms` per stream, in its own process) — `lorafleet router` pinned to core 0 (`taskset`) —
`bench/loadgen.py`'s aiohttp client in a separate process. The router's CPU is its processes' user +
system time (psutil) over each phase (`system_share`: the kernel's part), so the figures hold on a
machine shared with other work:

- `us_per_token`: router CPU over a closed loop of `--streams` streams of `--tokens` tokens each,
  divided by the tokens relayed (each request's own cost spread over its tokens included);
- `us_per_token_net`: the same less the per-request cost below, times the requests;
- `ms_per_request`: router CPU per non-streamed request (closed loop, raw keep-alive client);
- `burst`: `--burst` streamed requests sent at once, `--rounds` times: TTFT p50/p99 through the
  router and directly (the fake worker's own), and the difference;
- several router processes sharing the port (`--processes N`, SO_REUSEPORT): the same CPU figures
  summed over the processes (per-core cost unchanged means the processes scale with cores).

`--compare REF` runs the same phases on the router of git revision REF (from `git archive`, in a
temporary folder) in the same run: before/after figures from one machine state. `--callgrind` counts
instructions instead (`callgrind_counts`): figures a shared machine's load does not move.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.loadgen import Workload, run_load

ROOT = Path(__file__).resolve().parent.parent


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its children (a multi-process router's workers)."""
    proc = psutil.Process(pid)
    user = system = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            user, system = user + t.user, system + t.system
        except psutil.NoSuchProcess:
            pass
    return user, system


def checkout(ref: str) -> Path:
    """`ref`'s sources as an importable `lorafleet` (the layout setup.py maps) in a temporary folder."""
    where = Path(tempfile.mkdtemp(prefix="lorafleet-ref-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    shim = where / "shim" / "lorafleet"
    shutil.copytree(where / "common", shim)
    for folder in ("worker", "kernels", "router", "operator"):
        (shim / folder).symlink_to(where / folder)
    return where / "shim"


class Router:
    """`lorafleet router` in front of `upstream`, pinned to `cores`, from `pythonpath` (None: this tree)."""

    def __init__(self, port: int, upstream: int, cores: str | None, pythonpath: Path | None, processes: int,
                 flags: tuple[str, ...] = ()) -> None:
        pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
            env["PYTHONSAFEPATH"] = "1"  # the ref's package, not this tree's
        extra = ["--processes", str(processes)] if processes > 1 else []
        self.proc = subprocess.Popen(
            [*pin, sys.executable, "-m", "lorafleet", "router", "--port", str(port), "--log-level", "warning",
             "--worker", f"http://127.0.0.1:{upstream}", "--lora-modules", "a=/a", *extra, *flags],
            env=env, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir() if pythonpath else None)
        self.port = port

    def cpu(self) -> tuple[float, float]:
        """(user, system) CPU seconds so far."""
        return cpu_times(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class TcpRelay(Router):
    """The floor under any relay in Python: `tcp_relay` (below) in its own process, pinned like the
    router, in front of the same fake worker; measured by the same phases."""

    def __init__(self, port: int, upstream: int, cores: str | None) -> None:
        pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
        code = (f"import sys; sys.path.append({str(ROOT)!r}); from bench.router_stream import tcp_relay; "
                f"tcp_relay({port}, {upstream})")  # appended: the repository's folders shadow no module
        self.proc = subprocess.Popen([*pin, sys.executable, "-c", code], stderr=subprocess.DEVNULL)
        self.port = port


class Command(Router):
    """Any relay program in its own process, pinned like the router: `command` with `{port}` and
    `{upstream}` filled in (a relay written in C, say, for the floor outside Python)."""

    def __init__(self, port: int, upstream: int, cores: str | None, command: str) -> None:
        pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
        argv = shlex.split(command.format(port=port, upstream=upstream))
        self.proc = subprocess.Popen([*pin, *argv], cwd=ROOT, stderr=subprocess.DEVNULL)
        self.port = port


def tcp_relay(port: int, upstream: int) -> None:
    """A TCP relay on uvloop (asyncio without it): each client connection gets an upstream
    connection, and every read on either side is written to the other as it came (no parsing, no
    framing, no per-request work). Per streamed read: one `recv` and one `send` and two Python
    callbacks, the least any relay in Python does; per request the same, both ways."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    class Side(asyncio.Protocol):
        peer: Side | None = None
        transport: asyncio.Transport | None = None
        pending: list[bytes]

        def __init__(self) -> None:
            self.pending = []

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            peer = self.peer
            if peer is not None and peer.transport is not None:
                peer.transport.write(data)
            else:
                self.pending.append(data)

        def connection_lost(self, exc) -> None:
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()

    class Client(Side):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            up = Side()
            await loop.create_connection(lambda: up, "127.0.0.1", upstream)
            up.peer, self.peer = self, up
            for data in self.pending:
                up.transport.write(data)  # type: ignore[union-attr]
            self.pending.clear()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


def phases(router: Router, direct_port: int, args, closed_loop) -> dict:
    """The measured phases against one router; `closed_loop(port, concurrency, seconds)` -> req/s
    (router_overhead's raw non-streamed client)."""
    url = f"http://127.0.0.1:{router.port}"
    out: dict = {}
    # Streaming: CPU per relayed token.
    w = Workload("closed", concurrency=args.streams, duration_s=args.seconds, warmup_s=0.0,
                 new_tokens=args.tokens, fixed_length=True, prompt_tokens=8, model="a")
    run_load(url, Workload("burst", concurrency=8, rounds=1, new_tokens=4, prompt_tokens=8, model="a"))  # warm
    (u0, s0), t0 = router.cpu(), time.monotonic()
    stream = run_load(url, w)
    (u1, s1), wall = router.cpu(), time.monotonic() - t0
    cpu = (u1 - u0) + (s1 - s0)
    relayed = stream["tokens_per_s"] * args.seconds
    out["stream"] = {**stream, "router_cpu_s": round(cpu, 3), "router_cpu_share": round(cpu / wall, 3),
                     "us_per_token": round(1e6 * cpu / max(1.0, relayed), 2),
                     "system_share": round((s1 - s0) / max(cpu, 1e-9), 3)}  # the kernel's part (syscalls)
    # Non-streamed requests: CPU per request.
    asyncio.run(closed_loop(router.port, args.concurrency, 1.0))  # warm
    u0, s0 = router.cpu()
    rps = asyncio.run(closed_loop(router.port, args.concurrency, args.seconds))
    u1, s1 = router.cpu()
    cpu = (u1 - u0) + (s1 - s0)
    out["requests"] = {"req_per_s": round(rps, 1), "router_cpu_s": round(cpu, 3),
                       "ms_per_request": round(1e3 * cpu / max(1.0, rps * args.seconds), 4),
                       "system_share": round((s1 - s0) / max(cpu, 1e-9), 3)}
    requests = stream["requests"] or 1
    per_request_s = out["requests"]["ms_per_request"] / 1e3
    net = (out["stream"]["router_cpu_s"] - requests * per_request_s) / max(1.0, relayed)
    out["stream"]["us_per_token_net"] = round(1e6 * net, 2)
    # A burst of simultaneous streamed requests: TTFT through the router against the same burst direct.
    b = Workload("burst", concurrency=args.burst, rounds=args.rounds, duration_s=1.0 + args.burst_tokens * args.interval_ms / 1e3,
                 new_tokens=args.burst_tokens, fixed_length=True, prompt_tokens=8, model="a")
    routed = run_load(url, b)
    direct = run_load(f"http://127.0.0.1:{direct_port}", b)
    out["burst"] = {"requests": args.burst, "rounds": args.rounds,
                    "router_ttft_p50_ms": routed["ttft_p50_ms"], "router_ttft_p99_ms": routed["ttft_p99_ms"],
                    "direct_ttft_p50_ms": direct["ttft_p50_ms"], "direct_ttft_p99_ms": direct["ttft_p99_ms"],
                    "added_ttft_p50_ms": round(routed["ttft_p50_ms"] - direct["ttft_p50_ms"], 2),
                    "added_ttft_p99_ms": round(routed["ttft_p99_ms"] - direct["ttft_p99_ms"], 2),
                    "errors": routed["errors"] + direct["errors"]}
    return out


def start_upstream(port: int, interval_ms: float, cores: str | None, step_sync: bool = False) -> subprocess.Popen:
    """The fake worker; `step_sync`: every stream's token at one tick per interval (a batched
    engine's step), else each stream on its own schedule (`bench/fake_stream.py`)."""
    pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
    return subprocess.Popen([*pin, sys.executable, str(ROOT / "bench" / "fake_stream.py"), "--port", str(port),
                             "--interval-ms", str(interval_ms), *(["--step-sync"] if step_sync else [])],
                            cwd=ROOT, stderr=subprocess.DEVNULL)


def callgrind_counts(pythonpath: Path | None, fixed_requests, requests: int = 400, streams: int = 8,
                     tokens: int = 64, interval_ms: float = 40.0, idle_s: float = 10.0) -> dict:
    """Instructions (valgrind's callgrind, user space) one router process runs for a fixed workload:
    `requests` non-streamed requests 4 at a time (`fixed_requests(port, n, concurrency)`), `idle_s`
    of nothing (the background polls' rate), then `streams` streams of `tokens` tokens, one every
    `interval_ms` (slow enough that each upstream read holds one token under valgrind). Counted only
    during each phase (`--instr-atstart=no`, `callgrind_control -i`), so start-up is left out. The
    counts do not move with the machine's load, unlike CPU time. Needs `valgrind`; takes minutes."""
    up_port, port = _free_port(), _free_port()
    upstream = start_upstream(up_port, interval_ms, None)
    out = Path(tempfile.mkdtemp(prefix="router-callgrind-"))
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"], env["PYTHONSAFEPATH"] = str(pythonpath), "1"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
         sys.executable, "-m", "lorafleet", "router", "--port", str(port), "--log-level", "warning",
         "--worker", f"http://127.0.0.1:{up_port}", "--lora-modules", "a=/a"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=tempfile.gettempdir() if pythonpath else None)
    url = f"http://127.0.0.1:{port}"

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(proc.pid)], capture_output=True, check=False)

    def phase(name: str, work) -> float:
        control("-i", "on")
        t0 = time.monotonic()
        work()
        wall = time.monotonic() - t0
        control("-d", name)
        control("-i", "off")
        control("-z")
        return wall

    try:
        deadline = time.monotonic() + 900
        while not _ready(url):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the router under valgrind did not get ready")
            time.sleep(1.0)
        asyncio.run(fixed_requests(port, 40, 4))  # warm
        run_load(url, Workload("burst", concurrency=4, rounds=1, new_tokens=8, prompt_tokens=8, model="a"))
        walls = {"requests": phase("requests", lambda: asyncio.run(fixed_requests(port, requests, 4))),
                 "idle": phase("idle", lambda: time.sleep(idle_s))}
        load = Workload("burst", concurrency=streams, rounds=1, new_tokens=tokens, fixed_length=True,
                        prompt_tokens=8, model="a", duration_s=10.0)
        walls["stream"] = phase("stream", lambda: run_load(url, load))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        upstream.terminate()
        upstream.wait(timeout=10)
    counts = {}
    for f in out.glob("cg.*.*"):
        text = f.read_text(errors="replace")
        trigger = next((ln.split()[-1] for ln in text.splitlines() if ln.startswith("desc: Trigger:")), "")
        total = next((int(ln.split(":")[1]) for ln in text.splitlines() if ln.startswith("summary:")), 0)
        counts[trigger] = total
    shutil.rmtree(out, ignore_errors=True)
    background = counts.get("idle", 0) / walls["idle"]
    per_request = (counts["requests"] - background * walls["requests"]) / requests
    relayed = streams * tokens
    per_token = (counts["stream"] - background * walls["stream"] - streams * per_request) / relayed
    return {"instructions_per_request": round(per_request), "instructions_per_token_net": round(per_token),
            "background_instructions_per_s": round(background), "raw": counts,
            "phase_wall_s": {k: round(v, 2) for k, v in walls.items()}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--tcp-relay":
        tcp_relay(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit("usage: python -m bench.router_stream --tcp-relay PORT UPSTREAM_PORT")

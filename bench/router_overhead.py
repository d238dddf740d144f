"""Router overhead: added latency and max throughput of one router process, vs calling the worker directly.

Setup, all on loopback: a fast fake upstream (uvicorn, one process, answers /v1/completions with a
fixed body and serves /v1/adapters) — the router (one uvicorn process, `lorafleet` policy, open
mode, in-process placement) in front of it — a load generator (raw HTTP/1.1 keep-alive over asyncio) in this process.

1. Latency at a fixed rate (default 500 req/s, open loop): p50/p99 of end-to-end latency through
   the router and directly; added = router − direct at the same percentile.
2. Throughput: closed loop with C concurrent clients for a few seconds, through the router: req/s.
   The router process is pinned to one core (`taskset`, when present) so the figure is per core.

Usage: taskset -c 1 python bench/router_overhead.py [--rate 500] [--seconds 10] [--out bench/results/router_overhead.json]
(the router on core 0, the load generator and the upstream on core 1: on a two-core machine they
would otherwise take the router's core).

`--stream`: the streaming data path instead (bench/router_stream.py): router CPU per relayed token
and per request, TTFT of a burst of simultaneous streams, several router processes; `--compare REF`
measures git revision REF's router in the same run:
    taskset -c 1 python bench/router_overhead.py --stream --compare main --processes 1,2
`--stream --uvicorn`: also this tree's router with `--http-server uvicorn` (the fallback).
`--stream --floor`: also a bare TCP relay on uvloop (recv and send only), the floor under any relay in Python;
`--stream --relay-cmd "PROGRAM {port} {upstream}"`: also any relay program (one in C: the floor outside Python).
`--stream --pacing staggered,step` (the default: both, each variant in both before the next): the
fake worker's streams each on their own schedule, or all at one tick per interval as a batched
engine's steps emit them (bench/fake_stream.py).
`--stream --callgrind`: instructions per request and per token (valgrind), which a shared machine's
load does not move:
    python bench/router_overhead.py --stream --callgrind --compare main
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

UPSTREAM = """
import sys
from fastapi import FastAPI
from fastapi.responses import Response
import uvicorn
app = FastAPI()
BODY = b'{"id":"x","object":"text_completion","created":0,"model":"a","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'
INV = {"model": "base", "max_loras": 16, "max_cpu_loras": 64, "max_lora_rank": 16, "max_loras_per_request": 2,
       "adapters": [{"name": "a", "tier": "gpu", "rank": 8, "alpha": 16, "digest": "sha256:0", "path": "/a"}]}
@app.post("/v1/completions")
async def c():
    return Response(BODY, media_type="application/json")
@app.get("/v1/adapters")
async def a():
    return INV
@app.get("/health")
async def h():
    return {"status": "ok"}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str) -> None:
    for _ in range(200):
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(url)


class Conn:
    """A raw HTTP/1.1 keep-alive connection: far cheaper per request than an HTTP client library,
    so the generator is not the bottleneck on a small machine."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, request: bytes) -> None:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head[:200])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)


def request_bytes(port: int) -> bytes:
    body = json.dumps({"model": "a", "prompt": "hi", "max_tokens": 1}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
    return head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body


async def open_loop(port: int, rate: float, seconds: float, connections: int = 64) -> list[float]:
    """Requests at a fixed schedule (latency counted from the scheduled time: no coordinated omission)."""
    req = request_bytes(port)
    pool: asyncio.Queue[Conn] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(await Conn.open(port))
    latencies: list[float] = []

    async def one(scheduled: float, record: bool) -> None:
        conn = await pool.get()
        await conn.post(req)
        pool.put_nowait(conn)
        if record:
            latencies.append(time.perf_counter() - scheduled)

    await asyncio.gather(*(one(time.perf_counter(), False) for _ in range(200)))  # warm up
    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled, True)))
    await asyncio.gather(*tasks)
    return latencies


async def closed_loop(port: int, concurrency: int, seconds: float) -> float:
    req = request_bytes(port)
    conns = [await Conn.open(port) for _ in range(concurrency)]
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(conn: Conn) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await conn.post(req)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    return done / (time.perf_counter() - start)


def server_stack() -> dict[str, str]:
    """What uvicorn picks for the router (its "auto" choice) and the upstream client it uses."""
    import importlib.util

    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return {
        "http_parser": "httptools" if have("httptools") else "h11",
        "event_loop": "uvloop" if have("uvloop") else "asyncio",
        "upstream_client": "router/upstream.py (httptools protocols, keep-alive pool)",
        "stream_relay": "direct to uvicorn's transport (router/relay.py)",
    }


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, p))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--no-pin", action="store_true", help="do not pin the router to one core")
    p.add_argument("--out", type=Path, default=None,
                   help="default bench/results/router_overhead.json (--stream: router_stream.json)")
    s = p.add_argument_group("--stream")
    s.add_argument("--stream", action="store_true", help="measure the streaming data path")
    s.add_argument("--streams", type=int, default=64, help="concurrent streams")
    s.add_argument("--tokens", type=int, default=256, help="tokens per streamed request")
    s.add_argument("--interval-ms", type=float, default=8.0, help="the fake worker's time between a stream's tokens")
    s.add_argument("--burst", type=int, default=64, help="streamed requests sent at once")
    s.add_argument("--rounds", type=int, default=10)
    s.add_argument("--burst-tokens", type=int, default=16)
    s.add_argument("--processes", default="1", help="router process counts to measure, e.g. 1,2")
    s.add_argument("--compare", metavar="REF[,REF]", help="also measure these git revisions' routers (one process each)")
    s.add_argument("--uvicorn", action="store_true",
                   help="also measure this tree's router with --http-server uvicorn (every request through uvicorn's "
                   "ASGI cycle: the fallback)")
    s.add_argument("--floor", action="store_true",
                   help="also measure a bare TCP relay (bench/router_stream.py's tcp_relay): the kernel's and the "
                   "event loop's share, under any relay in Python")
    s.add_argument("--pacing", default="staggered,step",
                   help="the fake worker's pacing, one or both: staggered (each stream on its own schedule) and "
                   "step (every stream's token at one tick per --interval-ms, as a batched engine's step)")
    s.add_argument("--repeat", type=int, default=1, help="measure every variant this many times, interleaved")
    s.add_argument("--relay-cmd", metavar="CMD",
                   help="also measure this relay program ({port} and {upstream} filled in), e.g. a relay in C")
    s.add_argument("--callgrind", action="store_true",
                   help="instructions per request and per token under valgrind's callgrind instead of CPU time "
                   "(this tree and --compare's; printed, and added to --out's JSON under `callgrind` when given)")
    args = p.parse_args(argv)
    if args.stream and args.callgrind:
        return callgrind_main(args)
    if args.stream:
        return stream_main(args)
    args.out = args.out or ROOT / "bench/results/router_overhead.json"

    up_port, router_port = free_port(), free_port()
    load_before = [round(x, 2) for x in os.getloadavg()]
    pin = (
        ["taskset", "-c", "0"]
        if shutil.which("taskset") and (os.cpu_count() or 1) > 1 and not args.no_pin
        else []
    )
    procs = [subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])]
    try:
        wait(f"http://127.0.0.1:{up_port}/health")
        procs.append(
            subprocess.Popen(
                [
                    *pin,
                    sys.executable,
                    "-m",
                    "lorafleet",
                    "router",
                    "--port",
                    str(router_port),
                    "--log-level",
                    "warning",
                ]
                + ["--worker", f"http://127.0.0.1:{up_port}", "--lora-modules", "a=/a"],
                stderr=subprocess.DEVNULL,
            )
        )
        wait(f"http://127.0.0.1:{router_port}/ready")
        direct = asyncio.run(open_loop(up_port, args.rate, args.seconds))
        routed = asyncio.run(open_loop(router_port, args.rate, args.seconds))
        rps = asyncio.run(closed_loop(router_port, args.concurrency, args.seconds))
        rps_direct = asyncio.run(closed_loop(up_port, args.concurrency, args.seconds))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)

    result = {
        "rate_rps": args.rate,
        "seconds": args.seconds,
        "router_pinned_to_one_core": bool(pin),
        "direct_p50_ms": pct(direct, 50),
        "direct_p99_ms": pct(direct, 99),
        "router_p50_ms": pct(routed, 50),
        "router_p99_ms": pct(routed, 99),
        "added_p50_ms": pct(routed, 50) - pct(direct, 50),
        "added_p99_ms": pct(routed, 99) - pct(direct, 99),
        "router_max_rps_one_core": rps,
        "direct_max_rps": rps_direct,
        "concurrency": args.concurrency,
        "router_stack": server_stack(),
        "targets": {"added_p50_ms": 1.0, "added_p99_ms": 5.0, "router_max_rps_one_core": 1000},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "note": "load generator, upstream and router share this machine's cores; the generator's own cost is in both paths",
        "loadavg_at_start": load_before,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    result["targets_met"] = {
        "added_p50_ms": result["added_p50_ms"] <= 1.0,
        "added_p99_ms": result["added_p99_ms"] <= 5.0,
        "router_max_rps_one_core": rps >= 1000,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def stream_main(args: argparse.Namespace) -> int:
    from bench.router_stream import Command, Router, TcpRelay, checkout, phases, start_upstream

    out = args.out or ROOT / "bench/results/router_stream.json"
    pinned = shutil.which("taskset") and (os.cpu_count() or 1) > 1 and not args.no_pin
    pacings = [p for p in args.pacing.split(",") if p]
    if not pacings or set(pacings) - {"staggered", "step"}:
        raise SystemExit("--pacing: staggered, step or both")
    ports = {pacing: free_port() for pacing in pacings}
    upstreams = [start_upstream(port, args.interval_ms, "1" if pinned else None, pacing == "step")
                 for pacing, port in ports.items()]
    runs = []
    try:
        for port in ports.values():
            wait(f"http://127.0.0.1:{port}/health")
        variants = [(ref, checkout(ref), 1, ()) for ref in (args.compare or "").split(",") if ref]
        if args.uvicorn:
            variants.append(("this tree, uvicorn", None, 1, ("--http-server", "uvicorn")))
        variants += [("this tree", None, int(n), ()) for n in args.processes.split(",") if n]
        if args.floor:
            variants.append(("tcp relay (floor)", None, 0, ()))
        if args.relay_cmd:
            variants.append((f"command: {args.relay_cmd}", None, -1, ()))
        # Interleaved: every variant in each pacing, then the next repeat (a shared machine's load
        # moves between runs; medians over repeats, below).
        for repeat, (label, path, processes, flags), (pacing, up_port) in itertools.product(
                range(args.repeat), variants, ports.items()):
            load_before = [round(x, 2) for x in os.getloadavg()]
            cores = ("0" if processes <= 1 else f"0-{processes - 1}") if pinned else None
            router = (Router(free_port(), up_port, cores, path, processes, flags) if processes > 0
                      else TcpRelay(free_port(), up_port, cores) if processes == 0
                      else Command(free_port(), up_port, cores, args.relay_cmd))
            try:
                wait(f"http://127.0.0.1:{router.port}/ready")
                res = phases(router, up_port, args, closed_loop)
            finally:
                router.close()
            runs.append({"router": label, "pacing": pacing, "repeat": repeat, "processes": max(1, processes),
                         "cores": cores,
                         "flags": list(flags), "loadavg_before": load_before, **res})
            st, rq, bu = res["stream"], res["requests"], res["burst"]
            print(f"{label[:22]:<22} x{max(1, processes)} {pacing:<9}: {st['us_per_token']:6.2f} µs/token "
                  f"({st['us_per_token_net']:.2f} net) at {st['tokens_per_s']:,.0f} tok/s, ITL p50 "
                  f"{st['itl_p50_ms']} ms, router {st['router_cpu_share']:.0%} CPU (kernel {st['system_share']:.0%}); "
                  f"{rq['ms_per_request']:.4f} ms/request (kernel {rq['system_share']:.0%}, "
                  f"{rq['req_per_s']:,.0f} req/s); burst of "
                  f"{bu['requests']}: TTFT p99 +{bu['added_ttft_p99_ms']} ms (p50 +{bu['added_ttft_p50_ms']}), "
                  f"client CPU {st['client_cpu_share']}, errors {st['errors'] + bu['errors']}, load "
                  f"{load_before[0]}", flush=True)
    finally:
        for upstream in upstreams:
            upstream.terminate()
            upstream.wait(timeout=10)
    result = {
        "streams": args.streams, "tokens": args.tokens, "interval_ms": args.interval_ms, "seconds": args.seconds,
        "pacing": {"staggered": "each stream's tokens on its own schedule from its arrival (spread over the interval)",
                   "step": "every running stream's next token at one tick per interval, as a batched engine's step"},
        "router_pinned": bool(pinned), "runs": runs, "summary": summarize(runs, args.streams * 1e3 / args.interval_ms, args.interval_ms),
        "router_stack": server_stack(),
        "targets": {"us_per_token": 10.0, "ms_per_request": 0.1, "added_ttft_p99_ms": 5.0},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "note": "router CPU = its processes' user+system time over each phase (psutil); fake worker and client on core 1",
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["summary"]:
        print(f"median {row['router'][:22]:<22} x{row['processes']} {row['pacing']:<9}: {row['us_per_token']} µs/token "
              f"over {row['kept']} of {row['repeats']} runs, {row['ms_per_request']} ms/request, burst TTFT p99 "
              f"+{row['added_ttft_p99_ms']} ms")
    print(f"wrote {out}")
    return 0


def summarize(runs: list[dict], rate: float, interval_ms: float) -> list[dict]:
    """Per variant and pacing, the medians over its repeats; the per-token figure only over runs
    where the client kept up (at least 95% of the tokens/s sent, inter-token p50 at least 90% of the
    interval: each upstream read then held one token; a starved client reads several at once and
    makes the relay look cheaper)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["router"], run["processes"], run["pacing"]), []).append(run)
    rows = []
    for (router, processes, pacing), group in groups.items():
        kept = [r for r in group if r["stream"]["tokens_per_s"] >= 0.95 * rate
                and r["stream"]["itl_p50_ms"] >= 0.9 * interval_ms]
        rows.append({
            "router": router, "processes": processes, "pacing": pacing, "repeats": len(group), "kept": len(kept),
            "us_per_token": _median([r["stream"]["us_per_token"] for r in kept]),
            "us_per_token_net": _median([r["stream"]["us_per_token_net"] for r in kept]),
            "token_system_share": _median([r["stream"]["system_share"] for r in kept]),
            "ms_per_request": _median([r["requests"]["ms_per_request"] for r in group]),
            "request_system_share": _median([r["requests"]["system_share"] for r in group]),
            "added_ttft_p50_ms": _median([r["burst"]["added_ttft_p50_ms"] for r in group]),
            "added_ttft_p99_ms": _median([r["burst"]["added_ttft_p99_ms"] for r in group]),
            "loadavg_before": [r["loadavg_before"][0] for r in group],
        })
    return rows


def _median(xs: list[float]) -> float | None:
    return round(float(np.median(xs)), 4) if xs else None


async def fixed_requests(port: int, n: int, concurrency: int) -> None:
    """`n` non-streamed requests over `concurrency` kept-alive connections."""
    req = request_bytes(port)
    conns = [await Conn.open(port) for _ in range(concurrency)]

    async def worker(conn: Conn) -> None:
        for _ in range(n // concurrency):
            await conn.post(req)

    await asyncio.gather(*(worker(c) for c in conns))


def callgrind_main(args: argparse.Namespace) -> int:
    from bench.router_stream import callgrind_counts, checkout

    variants = [(ref, checkout(ref)) for ref in (args.compare or "").split(",") if ref] + [("this tree", None)]
    runs = []
    for label, path in variants:
        counts = callgrind_counts(path, fixed_requests)
        runs.append({"router": label, **counts})
        print(f"{label:<22} {counts['instructions_per_request']:>9,} instructions/request, "
              f"{counts['instructions_per_token_net']:>7,} /token net (background "
              f"{counts['background_instructions_per_s']:,}/s taken out)", flush=True)
    if args.out:  # kept beside what the file holds (the --stream run's CPU figures), under "callgrind"
        result = json.loads(args.out.read_text()) if args.out.exists() else {}
        result["callgrind"] = {"runs": runs, "python": platform.python_version(),
                               "workload": "400 requests 4 at a time; 10 s idle; 8 streams x 64 tokens at 40 ms"}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The worker's served path on a CPU, with a GPU step's time and none of its work: what the HTTP loop
costs per streamed token, and how much of the "GPU"'s time the host leaves idle.

    python bench/worker_stream.py [--step-ms 7] [--concurrency 64] [--new-tokens 128] [--prompt 128]
                                  [--seconds 10] [--rounds 3] [--compare REF[,REF]]
                                  [--variant NAME:ENV=V[,ENV=V]] [--out F]

`lorafleet worker` runs as it does in production (its CLI, uvicorn's httptools server, the engine
on its own thread) on the tiny model, except that the model's forward is a wait of `--step-ms`
that releases the GIL and returns random logits: a GPU step's time with no host compute in it. The
load generator (bench/loadgen.py, its own process) keeps `--concurrency` streams in a closed loop
with staggered output lengths. Per row:

- `tokens_per_s` against `ideal_tokens_per_s` = concurrency / step: the served ratio such a GPU
  would see from this host path (on a CPU the steps are synchronous: a step's host work, the
  scheduler, inputs, sampling and outputs, adds to the wait; on CUDA async scheduling overlaps it);
- `http_us_per_token`: the CPU time of the worker's main thread (the HTTP loop: parsing, routing,
  SSE framing and writes) over the window, per streamed token; `process_us_per_token`: all threads;
- TTFT and inter-token percentiles, errors, the client's CPU share.

Variants run interleaved, round by round: this tree, each `--compare` git revision (its sources
through PYTHONPATH, as bench/router_stream.py does), and each `--variant` (this tree with extra
environment, e.g. `gil200:LORAFLEET_SWITCH_INTERVAL_US=200` or `uvloop:LORAFLEET_WORKER_LOOP=uvloop`). The machine's load average is
recorded: on a shared machine the CPU times are what to compare, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(port: int, step_ms: float, model: str, concurrency: int) -> int:
    """`lorafleet worker`'s app under uvicorn as its CLI serves it, with the engine's model forward
    replaced by a wait once the engine is up (imports only `lorafleet`: a `--compare` revision's
    package comes through PYTHONPATH)."""
    import asyncio

    import torch
    import uvicorn

    from lorafleet.connection_guard import uvicorn_config
    from lorafleet.worker import envs
    from lorafleet.worker.server.app import create_apps
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    kind = getattr(envs, "WORKER_LOOP", None)  # a revision before the worker chose its loop ran on asyncio's
    if kind is None:
        factory = None
    else:
        from lorafleet.event_loop import loop_factory

        factory = loop_factory(kind)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003
        rows = kwargs.get("logits_indices", args[5] if len(args) > 5 else None)
        time.sleep(step_ms / 1000)
        return torch.randn(len(rows), vocab, generator=gen)  # tokens that print: every step streams an event

    settings = settings_from_args(build_parser().parse_args([
        "--model", model, "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
        "--dtype", "float32", "--max-num-seqs", str(concurrency), "--max-num-batched-tokens",
        str(max(2048, concurrency * 160))]))
    public, _admin = create_apps(settings)
    runtime = public.state.runtime

    async def serve() -> None:
        async def swap_forward() -> None:
            while runtime.engine is None:
                await asyncio.sleep(0.05)
            runtime.engine.engine.model.forward = forward

        task = asyncio.create_task(swap_forward())
        server = uvicorn.Server(uvicorn_config(public, "127.0.0.1", port, settings.connection_limits, log_level="warning"))
        await server.serve()
        task.cancel()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve())
    return 0


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, whole process) user + system CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    main = total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        t = (int(fields[11]) + int(fields[12])) / tick
        total += t
        if int(tid) == pid:
            main = t
    return main, total


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(variant: dict, args: argparse.Namespace, model: Path, vocab: int) -> dict:
    from bench.loadgen import Workload, run_load

    port = free_port()
    env = dict(os.environ, PYTHONSAFEPATH="1", **variant["env"])
    if variant["pythonpath"]:
        env["PYTHONPATH"] = variant["pythonpath"]
    log = tempfile.NamedTemporaryFile(prefix="worker-stream-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(port), str(args.step_ms),
                             str(model), str(args.concurrency)], env=env, cwd=tempfile.gettempdir(),
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not start (see {log.name})") from None
                time.sleep(0.3)
        common = dict(concurrency=args.concurrency, warmup_s=0.0, new_tokens=args.new_tokens,
                      prompt_tokens=args.prompt, vocab=vocab)
        run_load(f"http://127.0.0.1:{port}", Workload("closed", duration_s=3.0, **common))  # warm
        before = thread_cpu(proc.pid)
        t0 = time.monotonic()
        res = run_load(f"http://127.0.0.1:{port}", Workload("closed", duration_s=args.seconds, **common))
        wall = time.monotonic() - t0
        after = thread_cpu(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    # CPU over the load's whole run (its start-up and drain included) against the tokens streamed in it.
    tokens = res["tokens_per_s"] * args.seconds
    ideal = args.concurrency * 1000.0 / args.step_ms
    return {"variant": variant["name"], "tokens_per_s": res["tokens_per_s"], "ideal_tokens_per_s": ideal,
            "ratio": round(res["tokens_per_s"] / ideal, 3),
            "http_us_per_token": round((after[0] - before[0]) / max(tokens, 1) * 1e6, 1),
            "process_us_per_token": round((after[1] - before[1]) / max(tokens, 1) * 1e6, 1),
            "wall_s": round(wall, 1), **{k: res[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                               "errors", "requests", "client_cpu_share")},
            "load_avg": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=7.0, help="the forward's wait (an H100 decode step at 64: ~7 ms)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128, help="mean output length")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", default="", metavar="REF[,REF]", help="git revisions' workers, interleaved")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:ENV=V[,ENV=V]",
                   help="this tree with extra environment (repeat)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default: print only)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        port, step_ms, model, concurrency = args.child
        return child(int(port), float(step_ms), model, int(concurrency))

    sys.path.insert(0, str(ROOT))
    from bench.router_stream import checkout
    from bench.serve_assets import write_model

    model = write_model(Path(tempfile.gettempdir()) / "lorafleet-worker-stream" / "model-tiny", "cpu")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    variants = [{"name": "this tree", "env": {}, "pythonpath": ""}]
    for ref in (r for r in args.compare.split(",") if r):
        variants.append({"name": ref, "env": {}, "pythonpath": str(checkout(ref))})
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        env = dict(kv.split("=", 1) for kv in pairs.split(",") if kv)
        variants.append({"name": name, "env": env, "pythonpath": ""})
    rows = []
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            row = measure(v, args, model, vocab)
            row["round"] = r
            rows.append(row)
            print(f"round {r} {row['variant']:>12}: {row['tokens_per_s']:8,.0f} tok/s ({row['ratio']:.3f} of "
                  f"{row['ideal_tokens_per_s']:,.0f})  HTTP {row['http_us_per_token']:6.1f} µs/token  process "
                  f"{row['process_us_per_token']:6.1f}  TTFT p50 {row['ttft_p50_ms']} ms  ITL p99 {row['itl_p99_ms']} ms  "
                  f"err {row['errors']}  client {row['client_cpu_share']}  load {row['load_avg']}", flush=True)
    print(f"\nmedians over {args.rounds} rounds (step {args.step_ms:g} ms, {args.concurrency} streams, "
          f"{args.new_tokens} tokens on average, prompt {args.prompt}):")
    print("| variant | tok/s | of ideal | HTTP µs / token | process µs / token | TTFT p50 ms | ITL p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = []
    for v in variants:
        mine = [x for x in rows if x["variant"] == v["name"]]
        med = {k: statistics.median(x[k] for x in mine) for k in ("tokens_per_s", "ratio", "http_us_per_token",
                                                                 "process_us_per_token", "ttft_p50_ms", "itl_p99_ms")}
        summary.append({"variant": v["name"], "env": v["env"], **med})
        print(f"| {v['name']} | {med['tokens_per_s']:,.0f} | {med['ratio']:.3f} | {med['http_us_per_token']:.1f} | "
              f"{med['process_us_per_token']:.1f} | {med['ttft_p50_ms']:.1f} | {med['itl_p99_ms']:.1f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
                                        "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                                        "summary": summary, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

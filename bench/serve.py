"""The served path under load: `lorafleet worker` (and `lorafleet router` in front) driven over HTTP.

    python -m bench.serve --print-gpu-commands             # the GPU run in pieces of < 8 minutes each
    python -m bench.serve --device cuda --quick            # one GPU at once (~11 minutes: past a device call)
    python -m bench.serve --device cpu --concurrency 4 ... # the tiny model on a CPU: checks the suite

Steps, all in one run so every figure comes from one card (`--weights`: `bf16`, the model as
written, and/or `fp8`, the engine and the worker with `--quantization fp8`; step 3 for each kind,
then steps 4-5 for each kind in turn, one worker each; rows carry `weights`):
1. the load generator's self-check: `bench/fake_stream.py` streaming at `--selfcheck-rate` tokens/s
   (default 2x the engine's figure at the largest batch, at least 2,000) with a known TTFT; the
   generator must measure both (tokens/s within 5%, TTFT p50 within the TTFT plus one interval),
   else the run stops: what it would measure could be the client;
2. the model and adapters written (bench/serve_assets.py: the engine benchmark's random-weight
   model, seed shape on a GPU, tiny on a CPU; random rank-16 PEFT adapters a0..);
3. the engine's tokens/s at each closed-loop batch and adapter count (bench/engine.py's decode_run,
   in its own process, before the worker takes the GPU);
4. the worker started with the adapters, warmed up (every adapter count at the run's concurrency,
   outside the measurement windows); then the router in front, when `--paths` has `router`;
5. per path, prompt length and adapter count: a closed loop at each `--concurrency` (output lengths
   drawn from [n/4, 7n/4], staggered starts) and Poisson arrivals at each `--poisson` fraction of
   the peak that path's closed loop measured at the largest concurrency (bench/loadgen.py).

Writes bench/results/serve-<gpu>.json (`rows` as issue 55 names them plus `weights`, the self-check,
the engine rows, each weights kind's worker command line and the settings) and, with matplotlib,
serve-<gpu>.png (throughput against TTFT p50).
Each row also carries the worker's own view of its window (`worker`, from /metrics scraped at the
window's edges): mean running requests per engine step, steps by path (graph / eager) and their mean times.

In pieces, each well inside a 10-minute device call (`--print-gpu-commands` prints them;
bench/serve_pieces.py):
`--engine-only` writes the model (kept under `--workdir` for the next pieces) and the engine's
figures; later pieces pass `--no-engine --merge`, which keeps the JSON's engine figures and rows
and takes the Poisson rates from its closed-loop peaks (each weights kind from its own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.loadgen import Workload, run_load
from bench.serve_assets import WEIGHTS
from bench.serve_pieces import gpu_commands, merged, row_key, weights_of
from bench.serve_window import windowed

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "max_stall_ms", "errors",
            "client_cpu_share")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; its log:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready in {timeout_s:.0f}s; log:\n{log.read_text()[-3000:]}")


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def selfcheck(rate: float, processes: int, seconds: float) -> dict:
    """The generator against a fake worker at a known rate: tokens/s and TTFT it must measure."""
    interval_ms, ttft_ms = 10.0, 20.0
    streams = max(1, round(rate * interval_ms / 1e3))
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(ROOT / "bench" / "fake_stream.py"), "--port", str(port), "--interval-ms",
                             str(interval_ms), "--ttft-ms", str(ttft_ms)], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", fake, 30, Path(os.devnull))
        w = Workload("closed", concurrency=streams, duration_s=seconds, warmup_s=min(2.0, seconds / 3),
                     new_tokens=200, fixed_length=True, prompt_tokens=16)
        got = run_load(f"http://127.0.0.1:{port}", w, processes)
    finally:
        stop(fake)
    # Each request: its first token after ttft, the other n - 1 one interval apart; then the next.
    n = w.new_tokens
    expected = streams * n * 1e3 / (ttft_ms + (n - 1) * interval_ms)
    ok = (abs(got["tokens_per_s"] / expected - 1) <= 0.05 and ttft_ms <= got["ttft_p50_ms"] <= ttft_ms + interval_ms
          and got["errors"] == 0)
    return {"expected_tokens_per_s": expected, "expected_ttft_ms": ttft_ms, "streams": streams, **got, "ok": ok}


def engine_figures(device: str, batches: list[int], prompts: list[int], new_tokens: int, adapters: list[int],
                   log: Path, weights: str) -> dict[tuple[str, int, int, int], float]:
    """(weights, batch, prompt, adapters) -> the engine's tokens/s, each batch in its own process."""
    out: dict[tuple[str, int, int, int], float] = {}
    for batch in batches:
        for prompt in prompts:
            cmd = [sys.executable, str(ROOT / "bench" / "serve_assets.py"), "engine", "--device", device, "--batch", str(batch),
                   "--prompt", str(prompt), "--new-tokens", str(new_tokens),
                   "--adapters", ",".join(str(a) for a in adapters if a <= batch), "--weights", weights]
            with log.open("a") as err:
                res = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=900)
            if res.returncode != 0:
                print(f"engine figures for {weights} batch {batch} failed (see {log})", flush=True)
                continue
            for r in json.loads(res.stdout.strip().splitlines()[-1])["rows"]:
                out[(weights, batch, prompt, r["adapters"])] = r["tokens_per_s"]
    return out


def worker_cmd(args: argparse.Namespace, model: Path, adapters: dict[str, Path], port: int, weights: str) -> list[str]:
    slots = args.max_loras or max(max(args.adapters), 1)
    cmd = [sys.executable, "-m", "lorafleet", "worker", "--model", str(model), "--served-model-name", "base",
           "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
           "--max-num-seqs", str(max(args.concurrency)), "--max-loras", str(slots),
           "--max-cpu-loras", str(slots + 8), "--max-lora-rank", "16", "--max-loras-per-request", "1",
           "--log-level", "warning", "--admin-token-file", str(token_file(args)), "--load-format", "dummy"]
    if adapters:
        cmd += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    if not args.device.startswith("cuda"):
        cmd += ["--dtype", "float32"]
    if WEIGHTS[weights]:
        cmd += ["--quantization", WEIGHTS[weights]]
    return cmd + args.worker_arg


def token_file(args: argparse.Namespace) -> Path:
    """The admin token the router polls the worker's inventory with (/v1/adapters)."""
    path = args.workdir / "admin-token"
    if not path.exists():
        path.write_text(os.urandom(16).hex())
    return path


def names_for(count: int) -> tuple[str, ...]:
    return tuple(f"a{k}" for k in range(count))


def warm_up(url: str, args: argparse.Namespace, vocab: int) -> None:
    """Every adapter count at the run's largest concurrency and each prompt length, briefly (3 s):
    graph captures, adapter loads and first-use costs happen here, not in a measurement window."""
    for prompt in args.prompts:
        for d in args.adapters:
            # A short closed loop: prompts join decoding batches, so the graphs of such steps are captured here.
            w = Workload("closed", concurrency=max(args.concurrency, default=64), duration_s=3.0, warmup_s=0.0,
                         new_tokens=32, prompt_tokens=prompt, vocab=vocab, adapters=names_for(d))
            res = run_load(url, w, args.client_processes)
            if res["errors"]:
                raise RuntimeError(f"warm-up with {d} adapters failed: {res['first_error']}")


def measure(url: str, path: str, weights: str, prompt: int, d: int, args: argparse.Namespace, vocab: int,
            engine: dict, peaks: dict, worker_url: str) -> list[dict]:
    """One path, weights kind, prompt length and adapter count: the closed loops, then the Poisson rates.

    `peaks`: (weights, prompt, adapters) -> the closed loop's figures at the largest concurrency, from
    the first path measured: the Poisson rates of every path are fractions of the same peak."""
    rows = []
    base = {"path": path, "weights": weights, "adapters": d, "prompt": prompt, "new_tokens": args.new_tokens}
    common = dict(duration_s=args.seconds, warmup_s=args.warmup, new_tokens=args.new_tokens,
                  prompt_tokens=prompt, vocab=vocab, adapters=names_for(d))
    peak = None
    for c in sorted(args.concurrency):
        res, view = windowed(url, Workload("closed", concurrency=c, **common), args.client_processes, worker_url)
        rows.append(row(base, {"concurrency": c}, res, engine.get((weights, c, prompt, d)), view))
        peak = res
    peak = peaks.setdefault((weights, prompt, d), peak)
    if peak is None:
        if args.poisson:
            print(f"no {weights} closed-loop peak for prompt {prompt}, {d} adapters (run or merge one): no Poisson rows")
        return rows
    top = peak.get("concurrency") or max(args.concurrency, default=64)
    for frac in args.poisson:
        rate = frac * peak["tokens_per_s"] / max(1.0, peak["mean_new_tokens"] or args.new_tokens)
        res, view = windowed(url, Workload("poisson", rate=rate, **common), args.client_processes, worker_url)
        rows.append(row(base, {"rate": round(rate, 2), "of_peak": frac}, res, engine.get((weights, top, prompt, d)), view))
    return rows


def row(base: dict, load: dict, res: dict, engine_tps: float | None, worker: dict) -> dict:
    r = {**base, **load, **{k: res[k] for k in ROW_KEYS}, "engine_tokens_per_s": engine_tps,
         "requests": res["requests"], "client_processes": res["client_processes"],
         "mean_new_tokens": res["mean_new_tokens"], "worker": worker}
    if res["errors"]:
        r["first_error"] = res["first_error"]
    label = f"c={load['concurrency']}" if "concurrency" in load else f"{load['of_peak']:.0%} ({load['rate']}/s)"
    print(f"{r['path']:<7} {r['weights']:<4} {r['adapters']:>3} ad prompt {r['prompt']:>4} {label:<16} {r['tokens_per_s']:>9,.0f} tok/s "
          f"(engine {engine_tps or float('nan'):>8,.0f})  TTFT {r['ttft_p50_ms']:>8} / {r['ttft_p99_ms']:>8} ms  "
          f"ITL {r['itl_p50_ms']:>6} / {r['itl_p99_ms']:>7} ms  stall {r['max_stall_ms']:>7} ms  "
          f"err {r['errors']}  client {r['client_cpu_share']}  worker {worker}", flush=True)
    return r


def plot(rows: list[dict], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, ax = plt.subplots(figsize=(7, 4.5))

    def key(r: dict) -> tuple:
        return r["path"], weights_of(r), r["adapters"], r["prompt"]

    for k in sorted({key(r) for r in rows}):
        pts = sorted((r["tokens_per_s"], r["ttft_p50_ms"]) for r in rows if key(r) == k)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{k[0]}, {k[1]}, {k[2]} adapters, prompt {k[3]}")
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return f"wrote {out}"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


FULL = {"concurrency": [1, 16, 64, 256], "adapters": [0, 8, 64], "prompts": [128, 512], "poisson": [0.5, 0.7, 0.9],
        "seconds": 20.0, "warmup": 4.0}
QUICK = dict(FULL, concurrency=[64], prompts=[128], poisson=[0.7], seconds=10.0, warmup=2.5)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (the worker's --device)")
    p.add_argument("--quick", action="store_true",
                   help="concurrency 64 closed loop and 70%% Poisson; base, 8 and 64 adapters; prompt 128; "
                        "short windows (fits ~8 minutes on one GPU); the loads and windows given beside it are kept")
    p.add_argument("--concurrency", type=ints, default=None, help="closed loops (default 1,16,64,256)")
    p.add_argument("--adapters", type=ints, default=None, help="distinct adapters in rotation (default 0,8,64)")
    p.add_argument("--prompts", type=ints, default=None, help="prompt lengths (default 128,512)")
    p.add_argument("--poisson", type=lambda s: [float(x) for x in s.split(",") if x], default=None,
                   help="Poisson rates as fractions of the closed loop's peak (default 0.5,0.7,0.9)")
    p.add_argument("--weights", type=lambda s: [w for w in s.split(",") if w], default=["bf16"],
                   help="bf16 (the model as written) and/or fp8 (worker and engine with --quantization fp8), "
                        "each measured in turn with its own worker; rows carry `weights`")
    p.add_argument("--paths", default="direct,router")
    p.add_argument("--new-tokens", type=int, default=128, help="mean output length")
    p.add_argument("--seconds", type=float, default=None, help="each row's arrivals (default 20, --quick 10)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of each row before its window (default 4, --quick 2.5)")
    p.add_argument("--client-processes", type=int, default=None, help="default: 1 on a CPU, 4 on a GPU (its host's 16 cores)")
    p.add_argument("--selfcheck-rate", type=float, default=None, help="tokens/s (default: 2x the engine's peak)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine's figures (with --merge: keep the JSON's)")
    p.add_argument("--engine-only", action="store_true",
                   help="write the model and adapters and take the engine's figures, then stop (the first piece)")
    p.add_argument("--merge", action="store_true",
                   help="keep the existing JSON's engine figures and rows (a row measured again replaces its "
                        "namesake) and take Poisson rates from its closed-loop peaks")
    p.add_argument("--print-gpu-commands", action="store_true",
                   help="print the device commands that measure issue 55's rows in pieces, then stop")
    p.add_argument("--ignore-selfcheck", action="store_true",
                   help="measure even when the self-check fails (recorded in the JSON; a busy development machine)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "lorafleet-serve",
                   help="model and adapter folders, kept between runs (a device call keeps the repository's "
                        "ignored .lorafleet/ folder: pass .lorafleet/serve-work there)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="the worker's adapter slots (default: the largest --adapters; the same as another run's "
                        "workers where rows are compared with its rows)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra `lorafleet worker` argument (repeat)")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON file, or a folder for serve-<gpu>.json (default bench/results/); logs beside it")
    args = p.parse_args(argv)
    unknown = [w for w in args.weights if w not in WEIGHTS]
    if unknown or not args.weights:
        p.error(f"--weights {','.join(args.weights)}: bf16 and/or fp8")
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.client_processes is None:
        args.client_processes = 4 if args.device.startswith("cuda") else 1
    return args


def gpu_name() -> str:
    """A short name of GPU 0 for the file name (nvidia-smi: no CUDA context in this process)."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30).stdout.strip().lower()
    except (OSError, subprocess.TimeoutExpired):
        return "cuda"
    return next((g for g in ("h200", "h100", "a100", "l40s", "l4") if g in name), name.replace(" ", "-") or "cuda")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.print_gpu_commands:
        print(gpu_commands())
        return 0
    cuda = args.device.startswith("cuda")
    gpu = gpu_name() if cuda else "cpu"
    out = args.out or ROOT / "bench" / "results"
    out = out / f"serve-{gpu}.json" if out.is_dir() or not out.suffix else out
    logs = out.parent / f"{out.stem}-logs"  # the worker's, router's and engine's output
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    # Model and adapters, in a process of their own (on a GPU: no CUDA context left in this one).
    # The model's config and tokenizer; its weights made by the worker (--load-format dummy).
    model = args.workdir / ("model-seed-config" if cuda else "model-tiny-config")
    cmd = [sys.executable, str(ROOT / "bench" / "serve_assets.py"), "write", "--config-only", "--device", args.device,
           "--model", str(model),
           "--adapter-root", str(args.workdir / ("adapters-seed" if cuda else "adapters-tiny")),
           "--count", str(max(args.adapters))]
    written = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    adapters = {k: Path(v) for k, v in json.loads(written.stdout.strip().splitlines()[-1]).items()}
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    print(f"model and {len(adapters)} adapters ready in {time.monotonic() - t_start:.0f}s", flush=True)
    engine, old_rows, peaks, commands = merged(out, args)
    if not args.no_engine:
        for weights in args.weights:
            engine.update(engine_figures(args.device, sorted(args.concurrency), args.prompts, args.new_tokens,
                                         args.adapters, logs / "engine.log", weights))
        print(f"engine figures ({time.monotonic() - t_start:.0f}s): " + ", ".join(
            f"{w} batch {b} prompt {p} {d} adapters {v:,.0f}" for (w, b, p, d), v in engine.items()), flush=True)
    result = {"machine": gpu, "device": args.device, "date": time.strftime("%Y-%m-%d"),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "engine": [{"weights": w, "batch": b, "prompt": p, "adapters": d, "tokens_per_s": v}
                         for (w, b, p, d), v in engine.items()],
              "rows": list(old_rows), "worker_commands": commands}
    write(result, out, 0)  # the engine's figures kept should a time limit stop the served part
    if args.engine_only:
        return 0
    rate = args.selfcheck_rate or max(2000.0, 2 * max(engine.values(), default=1000.0))
    check = selfcheck(rate, args.client_processes, min(8.0, args.seconds))
    print(f"load generator self-check at {check['expected_tokens_per_s']:,.0f} tok/s: measured "
          f"{check['tokens_per_s']:,.0f} tok/s, TTFT p50 {check['ttft_p50_ms']} ms (expected "
          f"{check['expected_ttft_ms']} + one interval), client CPU {check['client_cpu_share']}: "
          f"{'ok' if check['ok'] else 'FAILED'}", flush=True)
    result["selfcheck"] = check
    if not check["ok"] and not args.ignore_selfcheck:
        print("the load generator cannot measure this rate here: stopping (see selfcheck in the JSON)")
        return write(result, out, 1)
    for weights in args.weights:
        serve_rows(args, weights, model, adapters, vocab, engine, peaks, result, out, logs, t_start)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    print(plot(result["rows"], out.with_suffix(".png")))
    print(f"wrote {out} ({result['seconds']:.0f}s)")
    return write(result, out, 0)


def serve_rows(args: argparse.Namespace, weights: str, model: Path, adapters: dict[str, Path], vocab: int,
               engine: dict, peaks: dict, result: dict, out: Path, logs: Path, t_start: float) -> None:
    """One worker with `weights` (and the router in front, when `--paths` has it): every row of
    this kind, added to `result["rows"]` and written after each combination."""
    paths = [p for p in args.paths.split(",") if p]
    suffix = "" if weights == "bf16" else f"-{weights}"
    worker = router = None
    try:
        port = free_port()
        cmd = worker_cmd(args, model, adapters, port, weights)
        result["worker_commands"][weights] = " ".join(cmd[2:])  # what each kind's rows measured
        worker = start(cmd, logs / f"worker{suffix}.log")
        wait_ready(f"http://127.0.0.1:{port}/ready", worker, 900, logs / f"worker{suffix}.log")
        direct = f"http://127.0.0.1:{port}"
        warm_up(direct, args, vocab)
        print(f"{weights} worker ready and warm ({time.monotonic() - t_start:.0f}s)", flush=True)
        urls = {"direct": direct}
        if "router" in paths:
            rport = free_port()
            router = start([sys.executable, "-m", "lorafleet", "router", "--port", str(rport), "--worker", direct,
                            "--log-level", "warning", "--admin-token-file", str(token_file(args)),
                            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())], logs / f"router{suffix}.log")
            wait_ready(f"http://127.0.0.1:{rport}/ready", router, 60, logs / f"router{suffix}.log")
            urls["router"] = f"http://127.0.0.1:{rport}"
        for prompt in args.prompts:
            for d in args.adapters:
                for path in paths:  # paired, so a run cut short still compares them
                    new = measure(urls[path], path, weights, prompt, d, args, vocab, engine, peaks, direct)
                    keys = {row_key(r) for r in new}
                    result["rows"] = [r for r in result["rows"] if row_key(r) not in keys] + new
                    write(result, out, 0)
    finally:
        stop(router)
        stop(worker)


def write(result: dict, out: Path, status: int) -> int:
    """Written after every measured combination too: a run stopped by a time limit keeps its rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())

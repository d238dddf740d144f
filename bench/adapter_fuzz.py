"""The adapter fuzz campaign (issue 49): malformed adapter folders loaded through a real worker's
authenticated admin API, each verdict checked against an independent judge, while a background
client streams greedy completions of a resident adapter and records how long its tokens wait.

    PYTHONSAFEPATH=1 python bench/adapter_fuzz.py --cases 2000              # seed from the clock
    PYTHONSAFEPATH=1 python bench/adapter_fuzz.py --cases 2000 --seed 49
    PYTHONSAFEPATH=1 python bench/adapter_fuzz.py --cases 200 --in-process   # the loader alone, no server

Cases: the fixed corpus (`adapter_fuzz_cases.corpus`), then seeded mutations of the demo adapters.
Verdicts (`adapter_fuzz_judge.Judge`: safetensors, PEFT, the accepted-config table, the caps):
valid → the load must answer 200 and the adapter must then serve; invalid → a 4xx with a reason.
Counted: invalid accepted, valid refused, 5xx, hangs (no answer in --hang-s), responses that name
a server path or the token, and the resident adapter's greedy output changing. Delays: gaps
between the background stream's tokens, before the campaign (baseline) and during it, split by
whether a load was in flight; every verdict is judged before the worker starts. Prints a
table and writes bench/results/adapter_fuzz-<seed>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: `bench.*` importable (appended: the repo's kernels/ must not shadow PyPI's)
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench.adapter_fuzz_cases import Case, base_cases, corpus, mutate  # noqa: E402
from bench.adapter_fuzz_judge import Caps, Judge  # noqa: E402

TOKEN = "fuzz-token-0123456789"
PROMPT = "SELECT name FROM students WHERE"


@dataclass
class Tally:
    cases: int = 0
    valid: int = 0
    invalid_accepted: list[str] = field(default_factory=list)
    valid_refused: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    not_served: list[str] = field(default_factory=list)  # loaded, but a request with it failed
    reasons: Counter = field(default_factory=Counter)
    load_seconds: list[float] = field(default_factory=list)
    windows: list[tuple[str, float, float]] = field(default_factory=list)  # (case, load start, serve check end)

    def record(self, name: str, valid: bool, why: str, status: int | None, reason: str | None, body: str) -> None:
        self.cases += 1
        self.valid += valid
        line = f"{name} [judge: {why}] -> {status} {reason or ''} {body[:160]}"
        if status is None:
            self.hangs.append(line)
        elif status >= 500:
            self.server_errors.append(line)
        elif valid and status != 200:
            self.valid_refused.append(line)
        elif not valid and status == 200:
            self.invalid_accepted.append(line)
        elif not valid and not (400 <= status < 500 and reason):
            self.server_errors.append(line + " (a refusal without a reason)")
        self.reasons[reason or ("loaded" if status == 200 else str(status))] += 1


def cases(demo: Path, seed: int, count: int) -> list[Case]:
    bases = base_cases(demo / "adapters")
    fixed = corpus(bases)
    rng = random.Random(seed)
    return (fixed + [mutate(bases, rng) for _ in range(max(0, count - len(fixed)))])[:count] if count else fixed


class GreedyProbe:
    """Streams greedy completions of a resident adapter back to back; records token gaps and outputs."""

    def __init__(self, url: str, adapter: str, max_tokens: int = 48) -> None:
        self.url, self.adapter, self.max_tokens = url, adapter, max_tokens
        self.gaps: list[tuple[float, float]] = []  # (when, seconds since the previous token)
        self.outputs: Counter = Counter()
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> GreedyProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        body = {"model": self.adapter, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                text, last = [], None
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            now = time.monotonic()
                            if last is not None:
                                self.gaps.append((now, now - last))
                            last = now
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                    self.outputs["".join(text)] += 1
                except (httpx.HTTPError, KeyError, ValueError):
                    self.errors += 1

    def gaps_between(self, t0: float, t1: float) -> list[float]:
        return [g for when, g in self.gaps if t0 <= when <= t1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(demo: Path, root: Path, token_file: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "lorafleet.cli", "worker", "--model", str(demo / "model"), "--port", str(port),
           "--host", "127.0.0.1", "--lora-modules", f"sql={demo / 'adapters' / 'sql'}", "--adapter-root", str(root),
           "--admin-token-file", str(token_file), "--dtype", "float32", "--max-lora-rank", "64",
           "--max-loras", "4", "--max-cpu-loras", "8"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the worker did not start; see {log}")


def load_over_http(url: str, name: str, rel: str, hang_s: float) -> tuple[int | None, str | None, str, float]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers, timeout=hang_s,
                       json={"lora_name": name, "lora_path": rel})
    except httpx.TimeoutException:
        return None, None, "no answer", time.monotonic() - t0
    dt = time.monotonic() - t0
    reason = None
    try:
        reason = r.json().get("error", {}).get("reason")
    except ValueError:
        pass
    return r.status_code, reason, r.text, dt


def serve_check(url: str, name: str) -> bool:
    """A loaded adapter answers a short greedy request, then unloads."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    ok = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": name, "prompt": PROMPT, "max_tokens": 3,
                                                               "temperature": 0}).status_code == 200
    httpx.post(f"{url}/v1/unload_lora_adapter", headers=headers, timeout=60, json={"lora_name": name})
    return ok


def run_campaign(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="adapter-fuzz-"))
    demo = Path(args.demo) if args.demo else work / "demo"
    if not (demo / "model").exists():
        subprocess.run([sys.executable, "-m", "lorafleet.cli", "demo-assets", "--out", str(demo)], check=True)
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    judge = Judge(demo / "model", Caps())
    all_cases = cases(demo, args.seed, args.cases)
    # Every verdict first, before the worker starts: the judge builds a PEFT model per new config,
    # and doing that on the worker's cores during the campaign would be counted as the loads' delay.
    verdicts = []
    for i, case in enumerate(all_cases):
        folder = root / f"c{i}"
        case.write(folder)
        verdicts.append(judge(folder))
        _remove(folder)
    tally = Tally()
    proc = url = probe = None
    if not args.in_process:
        proc, url = start_worker(demo, root, token_file, work / "worker.log")
        probe = GreedyProbe(url, "sql").start()
        time.sleep(args.baseline_s)
    else:
        import torch

        from lorafleet.worker.config import EngineConfig, ModelConfig
        from lorafleet.worker.lora.errors import AdapterError
        from lorafleet.worker.lora.reader import AdapterReader

        # The registry's reader: validation, the slot layout in float32, its finiteness check.
        reader = AdapterReader(ModelConfig.from_folder(demo / "model"), EngineConfig(max_lora_rank=64),
                               torch.float32, None)
    t_start = time.monotonic()
    try:
        for i, case in enumerate(all_cases):
            folder = root / f"c{i}"
            case.write(folder)
            verdict = verdicts[i]
            if args.in_process:
                t0 = time.monotonic()
                try:
                    reader.read(str(folder))
                    status, reason, body = 200, None, ""
                except AdapterError as exc:
                    status, reason, body = 400, exc.reason, str(exc)
                tally.load_seconds.append(time.monotonic() - t0)
            else:
                t0 = time.monotonic()
                status, reason, body, dt = load_over_http(url, f"c{i}", f"c{i}", args.hang_s)
                tally.load_seconds.append(dt)
                if status == 200 and not serve_check(url, f"c{i}"):
                    tally.not_served.append(case.name)
                tally.windows.append((case.name, t0, time.monotonic()))
            if str(work) in body or str(root) in body or TOKEN in body:
                tally.leaks.append(f"{case.name}: {body[:200]}")
            tally.record(case.name, verdict.valid, verdict.why, status, reason, body)
            _remove(folder)
            if args.progress and (i + 1) % args.progress == 0:
                print(f"{i + 1}/{len(all_cases)} cases, {tally.valid} valid, "
                      f"{len(tally.invalid_accepted)} invalid accepted, {len(tally.valid_refused)} valid refused, "
                      f"{len(tally.server_errors)} 5xx, {len(tally.hangs)} hangs", flush=True)
    finally:
        t_end = time.monotonic()
        if probe is not None:
            time.sleep(1.0)
            probe.stop()
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    return report(args, tally, probe, t_start, t_end, work)


def _remove(folder: Path) -> None:
    for p in [*folder.parent.glob(folder.name + ".outside.*"), folder]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 1)


def report(args, tally: Tally, probe: GreedyProbe | None, t_start: float, t_end: float, work: Path) -> dict:
    out = {
        "seed": args.seed, "cases": tally.cases, "valid": tally.valid, "invalid": tally.cases - tally.valid,
        "invalid_accepted": len(tally.invalid_accepted), "valid_refused": len(tally.valid_refused),
        "server_errors": len(tally.server_errors), "hangs": len(tally.hangs), "leaks": len(tally.leaks),
        "loaded_not_served": len(tally.not_served), "mode": "in-process" if args.in_process else "worker over HTTP",
        "load_p50_ms": _ms(tally.load_seconds, 0.5), "load_max_ms": _ms(tally.load_seconds, 1.0),
        "reasons": dict(tally.reasons.most_common()),
        "examples": {"invalid_accepted": tally.invalid_accepted[:20], "valid_refused": tally.valid_refused[:20],
                     "server_errors": tally.server_errors[:20], "hangs": tally.hangs[:20], "leaks": tally.leaks[:5],
                     "loaded_not_served": tally.not_served[:20]},
    }
    if probe is not None:
        base = probe.gaps_between(0, t_start)
        during = probe.gaps_between(t_start, t_end)
        med = statistics.median(base) if base else 0.0
        out["probe"] = {
            "baseline_tokens": len(base), "baseline_gap_p50_ms": _ms(base, 0.5), "baseline_gap_p99_ms": _ms(base, 0.99),
            "baseline_gap_max_ms": _ms(base, 1.0), "campaign_tokens": len(during),
            "campaign_gap_p50_ms": _ms(during, 0.5), "campaign_gap_p99_ms": _ms(during, 0.99),
            "campaign_gap_max_ms": _ms(during, 1.0),
            "max_delay_ms": round(1000 * (max(during) - med), 1) if during else None,
            "gaps_over_50ms_baseline": sum(g > 0.05 for g in base), "gaps_over_50ms_campaign": sum(g > 0.05 for g in during),
            # the same per minute of probing: the machine's own noise (baseline) against the campaign's
            "gaps_over_50ms_per_min_baseline": _per_min(base, 0, t_start, probe),
            "gaps_over_50ms_per_min_campaign": _per_min(during, t_start, t_end, probe),
            "greedy_outputs_distinct": len(probe.outputs), "probe_requests": sum(probe.outputs.values()),
            "probe_errors": probe.errors,
            # the same split by whether a load (or its serve check) was in flight: the loads' own share
            **_in_and_out(probe, tally.windows, t_start, t_end),
            "longest_gaps": _attribute(probe, tally.windows, t_start, t_end),
        }
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _per_min(gaps: list[float], t0: float, t1: float, probe: GreedyProbe) -> float | None:
    first = probe.gaps[0][0] if probe.gaps else t0
    minutes = (t1 - max(t0, first)) / 60
    return round(sum(g > 0.05 for g in gaps) / minutes, 1) if minutes > 0 else None


def _in_and_out(probe: GreedyProbe, windows: list[tuple[str, float, float]], t0: float, t1: float) -> dict:
    inside = sum(b - a for _, a, b in windows)
    outside = max(1e-9, (t1 - t0) - inside)
    starts = [a for _, a, _ in windows]
    ends = [b for _, _, b in windows]

    def in_load(when: float) -> bool:
        import bisect

        i = bisect.bisect_right(starts, when) - 1
        return i >= 0 and when <= ends[i]

    over = [(when, g) for when, g in probe.gaps if t0 <= when <= t1 and g > 0.05]
    n_in = sum(in_load(w) for w, _ in over)
    gaps_in = [g for w, g in probe.gaps if t0 <= w <= t1 and in_load(w)]
    gaps_out = [g for w, g in probe.gaps if t0 <= w <= t1 and not in_load(w)]
    return {"gap_p99_ms_during_loads": _ms(gaps_in, 0.99), "gap_max_ms_during_loads": _ms(gaps_in, 1.0),
            "gap_p99_ms_between_loads": _ms(gaps_out, 0.99), "gap_max_ms_between_loads": _ms(gaps_out, 1.0),
            "gaps_over_50ms_per_min_during_loads": round(n_in / (inside / 60), 1) if inside else None,
            "gaps_over_50ms_per_min_between_loads": round((len(over) - n_in) / (outside / 60), 1),
            "seconds_with_a_load_in_flight": round(inside, 1), "seconds_between_loads": round(outside, 1)}


def _attribute(probe: GreedyProbe, windows: list[tuple[str, float, float]], t0: float, t1: float,
               top: int = 10) -> list[str]:
    """The longest gaps of the campaign, each with the cases whose load overlapped it."""
    gaps = sorted(((g, when) for when, g in probe.gaps if t0 <= when <= t1), reverse=True)[:top]
    out = []
    for g, when in gaps:
        names = [n for n, a, b in windows if a < when and b > when - g]
        out.append(f"{1000 * g:.0f} ms during {', '.join(names) or 'no load (between cases)'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None, help="mutator seed (default: from the clock, printed)")
    ap.add_argument("--cases", type=int, default=2000, help="cases in all, the fixed corpus first (default 2000)")
    ap.add_argument("--demo", default=None, help="demo assets folder (default: made with `lorafleet demo-assets`)")
    ap.add_argument("--workdir", default=None, help="where the adapter root and logs go (default: a temp folder)")
    ap.add_argument("--in-process", action="store_true", help="call the loader directly instead of a worker")
    ap.add_argument("--hang-s", type=float, default=30.0, help="a load with no answer after this long is a hang")
    ap.add_argument("--baseline-s", type=float, default=10.0, help="probe alone before the campaign (default 10)")
    ap.add_argument("--progress", type=int, default=200, help="print a line every N cases (0: never)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/adapter_fuzz-<seed>.json)")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int(time.time()) % 1_000_000
    print(f"seed {args.seed}", flush=True)
    out = run_campaign(args)
    path = Path(args.out or Path(__file__).parent / "results" / f"adapter_fuzz-{args.seed}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    rows = [(k, v) for k, v in out.items() if not isinstance(v, dict)]
    rows += [(k, v) for k, v in out.get("probe", {}).items() if not isinstance(v, list)]
    for k, v in rows:
        print(f"{k:28} {v}")
    for line in out.get("probe", {}).get("longest_gaps", []):
        print(f"  gap: {line}")
    for kind, lines in out["examples"].items():
        for line in lines[:5]:
            print(f"  {kind}: {line}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

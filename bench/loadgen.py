"""The served benchmarks' load generator: streaming OpenAI completions over aiohttp, in client processes.

aiohttp's client (its C HTTP parser) reads a stream's bytes as they come; events are counted by their
`data:` prefix and only the last chunk's `usage` is parsed, so the client does little per token. Each
client process records its CPU share (process time over wall time): above ~0.7 a row measures the
client, not the server (`client_cpu_share`, the largest of the processes).

Workloads (`Workload.kind`):
- `closed`: `concurrency` streams, each sending its next request when the last ends; output lengths
  drawn uniformly from [new_tokens/4, 7·new_tokens/4] (a stream's first from [1, 2·new_tokens]), so
  the streams do not start, finish and restart together;
- `poisson`: open loop, requests at exponential gaps at `rate` per second (split over the client
  processes, whose sum is again Poisson), the same length distribution;
- `burst`: `concurrency` requests sent at once, `rounds` times, each round after the last ends.

Figures (`summarize`): tokens/s counted in the window (from `warmup_s` to the end of the arrivals),
TTFT and inter-token gaps of the requests sent in the window, the longest gap of any stream
(`max_stall_ms`), errors. Times are CLOCK_MONOTONIC, shared by the processes.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # closed | poisson | burst
    concurrency: int = 64
    rate: float = 0.0  # requests/s (poisson)
    duration_s: float = 10.0  # arrivals (poisson) or streams running (closed)
    warmup_s: float = 2.0
    rounds: int = 5  # burst
    new_tokens: int = 64
    fixed_length: bool = False  # every request asks for exactly new_tokens
    prompt_tokens: int = 128
    vocab: int = 500  # prompt token ids are drawn from [10, vocab)
    model: str = "base"
    adapters: tuple[str, ...] = ()  # requests name these in turn ("" = the base); empty: the base
    path: str = "/v1/completions"
    seed: int = 0


@dataclass(slots=True)
class Record:
    sent: float
    first: float = 0.0  # 0: no token came
    gaps: list[float] = field(default_factory=list)  # between consecutive token events, s
    events: int = 0
    tokens: int = 0  # the usage chunk's completion_tokens (else events)
    error: str = ""
    event_times: list[float] = field(default_factory=list)


def lengths(w: Workload, rng: random.Random, first: bool) -> int:
    if w.fixed_length:
        return w.new_tokens
    if first:
        return rng.randint(1, 2 * w.new_tokens)
    return rng.randint(max(1, w.new_tokens // 4), max(1, 7 * w.new_tokens // 4))


def request_body(w: Workload, rng: random.Random, index: int, new_tokens: int) -> bytes:
    model = w.adapters[index % len(w.adapters)] if w.adapters else w.model
    prompt = [rng.randrange(10, w.vocab) for _ in range(w.prompt_tokens)]  # random: no prefix-cache hits
    return json.dumps({"model": model or w.model, "prompt": prompt, "max_tokens": new_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}).encode()


async def stream_one(session: aiohttp.ClientSession, url: str, body: bytes, sent: float) -> Record:
    """One streamed request; TTFT from `sent` (its scheduled time: no coordinated omission)."""
    rec = Record(sent)
    last = b""  # the stream's end: its usage chunk and [DONE]
    times: list[float] = []  # one per `data:` event
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                rec.error = f"http {resp.status}: {(await resp.read())[:200]!r}"
                return rec
            tail = b""
            async for data in resp.content.iter_any():
                now = time.monotonic()
                n = (tail + data).count(b"data: ")  # a 5-byte tail cannot hold a whole `data: `
                tail = data[-5:]
                if n:
                    times.extend([now] * n)
                last = (last + data)[-8192:]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    events = [e for e in last.split(b"\n\n") if e.startswith(b"data: ")]
    done = bool(events) and events[-1] == b"data: [DONE]"
    if not done:
        rec.error = "stream ended without [DONE]"
    drop = int(done)
    usage = None
    for e in reversed(events[:-1] if done else events):
        if b'"error"' in e[:40]:
            rec.error = e[:200].decode("latin-1")
            drop += 1
        elif b'"usage"' in e and b'"choices":[]' in e:
            try:
                usage = int(json.loads(e[6:])["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                rec.error = "unreadable usage chunk"
            drop += 1
        break
    tokens_times = times[: max(0, len(times) - drop)]
    rec.events = len(tokens_times)
    rec.tokens = usage if usage is not None else rec.events
    if tokens_times:
        rec.first = tokens_times[0]
        rec.gaps = np.diff(tokens_times).tolist()
    rec.event_times = tokens_times
    return rec


async def drive(url: str, w: Workload, part: int, parts: int, start_at: float) -> tuple[list[Record], float, float]:
    """This process's share of the workload -> (records, CPU seconds, wall seconds)."""
    rng = random.Random(w.seed * 1000 + part)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    records: list[Record] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        target = url + w.path
        delay = start_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        cpu0, wall0 = time.process_time(), time.monotonic()
        counter = iter(range(part, 1 << 30, parts))
        if w.kind == "closed":
            share = w.concurrency // parts + (1 if part < w.concurrency % parts else 0)
            end = start_at + w.duration_s

            async def stream(k: int) -> None:
                first = True
                while time.monotonic() < end:
                    body = request_body(w, rng, next(counter), lengths(w, rng, first))
                    first = False
                    records.append(await stream_one(session, target, body, time.monotonic()))

            await asyncio.gather(*(stream(k) for k in range(share)))
        elif w.kind == "poisson":
            rate = w.rate / parts
            tasks = []
            t = start_at + rng.expovariate(rate)
            while t < start_at + w.duration_s:
                now = time.monotonic()
                if t > now:
                    await asyncio.sleep(t - now)
                body = request_body(w, rng, next(counter), lengths(w, rng, False))
                tasks.append(asyncio.ensure_future(stream_one(session, target, body, t)))
                t += rng.expovariate(rate)
            records.extend(await asyncio.gather(*tasks))
        elif w.kind == "burst":
            share = w.concurrency // parts + (1 if part < w.concurrency % parts else 0)
            for r in range(w.rounds):
                # Rounds start on a shared schedule, so the processes' bursts coincide.
                at = start_at + r * w.duration_s
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                bodies = [request_body(w, rng, next(counter), w.new_tokens) for _ in range(share)]
                now = time.monotonic()
                records.extend(await asyncio.gather(*(stream_one(session, target, b, now) for b in bodies)))
        else:
            raise ValueError(f"unknown workload kind {w.kind!r}")
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    return records, cpu, wall


def _child(url: str, w: Workload, part: int, parts: int, start_at: float, conn) -> None:
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    try:
        records, cpu, wall = run(drive(url, w, part, parts, start_at))
        conn.send(([asdict(r) for r in records], cpu, wall))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        conn.send(repr(exc))
    finally:
        conn.close()


def run_load(url: str, w: Workload, processes: int = 1, on_start=None) -> dict:
    """Runs `w` against `url` from `processes` client processes; returns `summarize`'s figures.
    `on_start(start_at)`, once the processes are started: the caller's hook on the shared schedule
    (bench/serve.py scrapes the worker's metrics at the window's edges)."""
    ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    start_at = time.monotonic() + 0.5 + 0.1 * processes
    pipes, procs = [], []
    for part in range(processes):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(url, w, part, processes, start_at, child), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    if on_start is not None:
        on_start(start_at)
    records: list[Record] = []
    shares = []
    for pipe, proc in zip(pipes, procs):
        got = pipe.recv()
        proc.join()
        if isinstance(got, str):
            raise RuntimeError(f"client process failed: {got}")
        recs, cpu, wall = got
        records += [Record(**r) for r in recs]
        shares.append(cpu / wall if wall > 0 else 0.0)
    out = summarize(records, w, start_at)
    out["client_cpu_share"] = round(max(shares), 3)
    out["client_processes"] = processes
    return out


def summarize(records: list[Record], w: Workload, start_at: float) -> dict:
    if w.kind == "burst":
        window_start, window_end = start_at, max((r.event_times[-1] for r in records if r.event_times), default=start_at)
        measured = records
    else:
        window_start, window_end = start_at + w.warmup_s, start_at + w.duration_s
        measured = [r for r in records if window_start <= r.sent < window_end]
    span = max(1e-9, window_end - window_start)
    tokens = 0.0
    for r in records:
        if r.event_times:
            inside = sum(1 for t in r.event_times if window_start <= t < window_end)
            tokens += inside * (r.tokens / len(r.event_times))
    ok = [r for r in measured if not r.error and r.first]
    ttft = np.array([r.first - r.sent for r in ok]) * 1e3
    gaps = np.concatenate([np.asarray(r.gaps) for r in ok if r.gaps] or [np.zeros(0)]) * 1e3

    def pct(xs: np.ndarray, q: float) -> float:
        return round(float(np.percentile(xs, q)), 2) if xs.size else float("nan")

    return {
        "requests": len(measured),
        "tokens_per_s": round(tokens / span, 1),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99),
        "max_stall_ms": round(float(gaps.max()), 2) if gaps.size else float("nan"),
        "errors": sum(1 for r in records if r.error),
        "first_error": next((r.error for r in records if r.error), ""),
        "mean_new_tokens": round(float(np.mean([r.tokens for r in ok])), 1) if ok else 0.0,
    }

"""The engine on its own thread, driven from asyncio.

The engine is single-threaded and not thread-safe, so exactly one thread ("engine") touches it.
It runs `step()` while there is work and sleeps on its command queue when there is none. Every
other engine call (add, abort, load, inventory) is a command marshalled onto that thread; results
come back to the caller's event loop with `call_soon_threadsafe`. Each request has its own
asyncio queue of step outputs; a request whose consumer goes away is aborted, which frees its KV
blocks and releases its adapters.

Adapters of waiting requests that fell out of the CPU cache are read from disk in a small thread
pool (`registry.read`), then inserted on the engine thread, so a step never waits on disk.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from lorafleet.worker import envs
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.outputs import RequestOutput
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.lora.adapter import AdapterError, LoraWeights
from lorafleet.worker.lora.registry import AdapterEntry, AdapterRegistry

log = logging.getLogger("lorafleet.worker.engine.async_engine")

T = TypeVar("T")
Command = Callable[[], None]
_STOP = object()
_IDLE_POLL_S = 0.05  # wake-up bound while waiting requests only wait for adapter reads


class EngineFailure(RuntimeError):
    """The engine raised inside a step; the requests in that step are failed with this."""


class StepObserver(Protocol):
    """Timing callbacks, called on the engine thread (the metrics module implements them)."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_token_gap(self, seconds: float) -> None: ...

    def on_finished(self, reason: str, prompt_tokens: int, generated: int, seconds: float) -> None: ...

    def on_step(self, running: int, waiting: int, tokens: int, seconds: float, path: str) -> None:
        """After an engine step that ran a forward: the requests running and waiting then, the
        tokens it computed, its wall time (async scheduling: launching one step and reading the
        one before) and its path ("graph" or "eager", `ModelRunner.last_forward`)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None  # set on the engine thread when the request is queued
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    done: bool = False


class RequestStream:
    """Async iterator over one request's step outputs; `cancel()` aborts it (idempotent)."""

    def __init__(self, engine: AsyncEngine, stream: _Stream) -> None:
        self._engine = engine
        self._stream = stream

    @property
    def request_id(self) -> int | None:
        return self._stream.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._stream.done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self._stream.done = True
            raise item
        if item.finished:
            self._stream.done = True
        return item

    def cancel(self) -> None:
        """Abort the request unless it already finished; safe from any coroutine, never blocks."""
        if not self._stream.done:
            self._stream.done = True
            self._engine.post(lambda: self._engine._abort(self._stream))


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None, read_threads: int = 2) -> None:
        self.engine = engine
        engine.read_adapters_inline = False  # we read in `_pool` instead
        self.observer = observer
        self._commands: queue.SimpleQueue[Command | object] = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._reading: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="lora-read")
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.alive = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.alive = True
        set_switch_interval(envs.SWITCH_INTERVAL_US)
        self._thread.start()

    async def stop(self) -> None:
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- calls onto the engine thread -------------------------------------------------------------
    def post(self, command: Command) -> None:
        """Run `command` on the engine thread, fire and forget."""
        self._commands.put(command)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread and await its result (or exception)."""
        if not self.alive:
            raise EngineFailure("the engine thread is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    async def submit(
        self, prompt: str | list[int], sampling: SamplingParams, adapters: Sequence[tuple[str, float]] = ()
    ) -> RequestStream:
        """Queue a request. Raises what `LLMEngine.add_request` raises before anything streams."""
        stream = _Stream(loop=asyncio.get_running_loop())

        def add() -> None:
            stream.request_id = self.engine.add_request(prompt, sampling, adapters)
            self._streams[stream.request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            self.post(lambda: self._abort(stream))  # `add` may still run after we stop waiting
            raise
        return RequestStream(self, stream)

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            # Sleep on the queue when idle, or when every waiting request waits for a disk read.
            waiting_on_disk = busy and not engine.scheduler.running and bool(self._reading)
            if not self._drain(block=not busy or waiting_on_disk, timeout=_IDLE_POLL_S if busy else None):
                break
            if not engine.has_unfinished():
                continue
            self._start_reads()
            forwards, t0 = engine.runner.forwards, time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug must not kill the worker silently
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}"))
                continue
            if self.observer is not None and engine.runner.forwards != forwards:
                path, tokens = engine.runner.last_forward
                sched = engine.scheduler
                self.observer.on_step(len(sched.running), len(sched.waiting), tokens, time.perf_counter() - t0, path)
            self._dispatch(outputs)
        self.alive = False
        self._fail_all(EngineFailure("the engine is shutting down"))

    def _drain(self, block: bool, timeout: float | None) -> bool:
        """Run queued commands; False once asked to stop."""
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            try:
                command()  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - commands report their own errors; this is a bug
                log.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.observer is not None:
                if stream.last_token is None:
                    self.observer.on_first_token(now - stream.arrival)
                else:
                    self.observer.on_token_gap(now - stream.last_token)
                if out.finished:
                    self.observer.on_finished(
                        out.finish_reason or "stop", out.num_prompt_tokens, out.num_generated, now - stream.arrival
                    )
            stream.last_token = now
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():  # one wake-up per event loop per step, not per token
            _call_threadsafe(loop, _deliver, items)

    def _abort(self, stream: _Stream) -> None:
        rid = stream.request_id
        if rid is not None and self._streams.pop(rid, None) is not None:
            self.engine.abort(rid)
            if self.observer is not None:
                self.observer.on_finished("abort", 0, 0, time.monotonic() - stream.arrival)

    def _fail(self, rid: int, exc: BaseException) -> None:
        stream = self._streams.pop(rid, None)
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - best effort while failing
            log.exception("abort of request %d failed", rid)
        if stream is not None:
            _call_threadsafe(stream.loop, _deliver, [(stream.queue, exc)])

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            self._fail(rid, exc)

    # -- adapter reads off the engine thread -------------------------------------------------------
    def _start_reads(self) -> None:
        registry = self.engine.registry
        for seq in self.engine.scheduler.waiting:
            for name in seq.adapter_names:
                if name in self._reading or registry.on_cpu(name):
                    continue
                entry = registry.entries.get(name)
                if entry is None:
                    continue
                self._reading.add(name)
                t0 = time.perf_counter()
                future = self._pool.submit(_read_with_digest, registry, entry)
                future.add_done_callback(
                    lambda f, n=name, en=entry, t=t0: self.post(lambda: self._finish_read(n, en, f, t))
                )

    def _finish_read(self, name: str, read_for: AdapterEntry, future: Future, t0: float) -> None:
        self._reading.discard(name)
        registry = self.engine.registry
        if registry.entries.get(name) is not read_for:
            return  # unloaded or replaced while we read
        try:
            weights = future.result()
            if weights.digest.value != read_for.digest.value:
                raise AdapterError("changed_on_disk", f"adapter {name!r} changed on disk since it was loaded; reload it")
        except Exception as exc:  # noqa: BLE001 - fail the requests that needed it, keep serving
            log.warning("re-reading adapter %s failed: %s", name, exc)
            for seq in list(self.engine.scheduler.waiting):
                if name in seq.adapter_names:
                    self._fail(seq.seq_id, exc)
            return
        registry.insert_cpu(name, weights)
        registry.stats.cpu_misses += 1
        registry.stats.record_load("disk", time.perf_counter() - t0)


def set_switch_interval(microseconds: float | None) -> None:
    """The engine thread and the HTTP loop share the GIL: a thread that wants it waits until the
    holder blocks or the switch interval passes (Python's default 5 ms). After a decode step's
    outputs are delivered, the HTTP loop writes every stream's chunk in one run of Python; the
    engine thread, ready to launch the next step, can wait that long with the GPU idle.
    None: the interpreter's setting is left alone."""
    if microseconds is None:
        return
    if microseconds <= 0:
        raise ValueError(f"LORAFLEET_SWITCH_INTERVAL_US must be > 0, got {microseconds}")
    sys.setswitchinterval(microseconds / 1e6)
    log.info("thread switch interval %.0f µs", microseconds)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _read_with_digest(registry: AdapterRegistry, entry: AdapterEntry) -> LoraWeights:
    """Re-read an evicted adapter in a worker thread, digests included (compared on the engine thread)."""
    weights = registry.read(entry.path)
    for digest in (weights.digest, entry.digest):  # wait for both hashes here, not on the engine thread
        digest.value  # noqa: B018
    return weights

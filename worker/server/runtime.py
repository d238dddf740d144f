"""What the routes share: settings, metrics, the admin token and the engine (built after start-up)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from lorafleet.worker.engine.async_engine import AsyncEngine
from lorafleet.worker.engine.parallel import Ranks
from lorafleet.worker.lora.fetch import AdapterFetcher
from lorafleet.worker.openai.reasoning import marker_ids
from lorafleet.worker.server.auth import AdminToken
from lorafleet.worker.server.errors import ApiError
from lorafleet.worker.server.gc_freeze import freeze_startup_objects
from lorafleet.worker.server.metrics import WorkerMetrics
from lorafleet.worker.server.settings import WorkerSettings

log = logging.getLogger("lorafleet.worker")


@dataclass(slots=True)
class WorkerRuntime:
    """Everything the routes share; created per app, never at import time."""

    settings: WorkerSettings
    metrics: WorkerMetrics
    admin_token: AdminToken
    engine: AsyncEngine | None = None
    error: str | None = None  # why the engine failed to start
    reasoning_markers: tuple[int, int] | None = None  # --reasoning-parser's <think>, </think> token ids
    loads: dict[tuple, asyncio.Task] = field(default_factory=dict)  # single flight per (name, path, ...)
    fetcher: AdapterFetcher = field(default_factory=AdapterFetcher.from_env)  # s3:// and hf:// sources, their cache
    _task: asyncio.Task | None = None
    ranks: Ranks | None = None  # --tensor-parallel-size > 1: the other ranks, started and watched here

    @classmethod
    def create(cls, settings: WorkerSettings) -> WorkerRuntime:
        return cls(
            settings=settings,
            metrics=WorkerMetrics(settings.model_name, settings.engine.max_loras),
            admin_token=AdminToken(settings.admin_token_file),
        )

    def require_engine(self) -> AsyncEngine:
        if self.engine is None or not self.engine.alive:
            raise ApiError(503, self.error or "the model is still loading; retry when /ready answers 200")
        return self.engine

    async def start(self) -> None:
        self._task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        from lorafleet.worker.engine.engine import LLMEngine
        from lorafleet.worker.engine.tokenizer import Tokenizer

        s = self.settings
        try:
            if s.reasoning_parser is not None:  # before the weights: a vocabulary without the markers fails at once
                tokenizer = await asyncio.to_thread(Tokenizer, s.tokenizer or s.model)
                self.reasoning_markers = marker_ids(tokenizer, s.reasoning_parser)
            if s.engine.tensor_parallel_size > 1:
                self.ranks = await asyncio.to_thread(Ranks.start, s.model, s.engine)
                asyncio.create_task(self._watch_ranks())
            engine = await asyncio.to_thread(
                LLMEngine, s.model, s.engine, s.tokenizer, dict(s.lora_modules), None,
                None if self.ranks is None else self.ranks.group,
            )
        except Exception as exc:  # noqa: BLE001 - reported on /health and /ready, and logged
            # Clients see the error's kind only: its text names files on this machine.
            self.error = f"the engine failed to start ({type(exc).__name__}); the worker's log says why"
            log.error("the engine failed to start: %s: %s", type(exc).__name__, exc)
            return
        if s.freeze_gc:
            frozen = freeze_startup_objects()
            log.info("start-up objects taken out of the cycle collector: %d", frozen)
        async_engine = AsyncEngine(engine, observer=self.metrics)
        async_engine.start()
        self.engine = async_engine
        log.info("ready: serving %r with adapters %s", s.model_name, sorted(engine.registry.names()))

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.engine is not None:
            await self.engine.stop()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)

    async def _watch_ranks(self) -> None:
        """One rank's exit stops the worker: `error` set makes `serve` shut the servers down."""
        while self.ranks is not None and self.error is None:
            failure = self.ranks.failure()
            if failure is not None:
                log.error("%s", failure)
                self.error = failure
                return
            await asyncio.sleep(0.5)

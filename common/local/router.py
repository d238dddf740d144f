"""The router of `lorafleet up`, served by uvicorn inside the `up` process.

In-process so that, without Redis, the router and the placement loop share one in-memory placement
store; and so that `up` owns SIGINT/SIGTERM (uvicorn would otherwise take them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from lorafleet.connection_guard import ConnectionLimits, uvicorn_config
from lorafleet.local.preflight import FleetError


class RouterServer:
    """uvicorn in this event loop, with our signal handling (uvicorn would take SIGINT/SIGTERM)."""

    def __init__(self, app, host: str, port: int, log_level: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # noqa: ANN202 - uvicorn's hook
                yield

        # The router's default connection limits (connection_guard): local, but still on a port.
        config = uvicorn_config(app, host, port, ConnectionLimits(), log_level=log_level, access_log=False)
        self.server = Server(config)
        self.task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        self.task = asyncio.create_task(self.server.serve())
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self.task.done() or time.monotonic() > deadline:
                raise FleetError("the router did not start (is its port taken?)")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 10.0)
        except (asyncio.TimeoutError, Exception, SystemExit):
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

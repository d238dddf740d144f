"""The event loop a server process runs on: uvloop where it is installed, asyncio's own otherwise.

uvicorn's `loop="auto"` makes that choice only when uvicorn creates the loop (`uvicorn.run`,
`Server.run`); a process that starts its servers inside `asyncio.run` (the worker: several
servers and the engine's watcher in one loop) gets asyncio's loop unless it asks. On the worker's
streaming path uvloop does the transports' writes and the polling in C, with the GIL released
while it waits, which the engine thread shares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's `new_event_loop` if it imports, else None (asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop

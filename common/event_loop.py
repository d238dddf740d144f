"""The event loop a server process runs on: asyncio's own, or uvloop.

uvicorn's `loop="auto"` picks uvloop when uvicorn creates the loop (`uvicorn.run`, `Server.run`:
the router). The worker starts its servers inside its own loop and keeps asyncio's by default:
its HTTP loop shares the GIL with the engine thread, and asyncio's socket writes release the GIL
for each `send` (a chance for the engine thread to launch the next step), where uvloop writes
from C holding it. On a 2-core machine (`bench/worker_stream.py`, a GPU step's wait in place of
the forward), the worker on uvloop streamed fewer tokens than a worker on asyncio in the same
round in 13 of 15 interleaved pairs (docs/benchmarks.md, the served path);
`LORAFLEET_WORKER_LOOP=uvloop` is there for the same comparison on a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LOOPS = ("asyncio", "uvloop")


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory `asyncio.Runner` takes for `kind` ("asyncio": None, its default)."""
    if kind not in LOOPS:
        raise ValueError(f"event loop {kind!r} is not one of {', '.join(LOOPS)}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise ValueError("event loop 'uvloop' asked for, but uvloop is not installed") from None
    return uvloop.new_event_loop

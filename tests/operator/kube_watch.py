"""Watch streams of the test emulator (`kmock_harness`), with a real API server's semantics.

Every write is kept as an event with its resourceVersion: a watch from a `resourceVersion` resumes
after it (no replay), a watch without one starts with ADDED for every current object. kmock's own
watch replays every object and then subscribes, so an event between the two is lost and a stale
ADDED arrives last: kopf then patches with an old resourceVersion forever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
from kmock._internal import rendering

from tests.operator.kube_api import matches_selector

# A watch with no events notices a hung-up client only by looking; this often.
_DISCONNECT_POLL_S = 0.5


@dataclass(slots=True)
class WatchLog:
    """Every change, in order, as (resourceVersion, resource, event); watches follow it."""

    events: list[tuple[int, Any, dict[str, Any]]] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def append(self, res: Any, kind: str, raw: dict[str, Any]) -> None:
        async with self.changed:
            self.events.append((int(raw["metadata"]["resourceVersion"]), res, {"type": kind, "object": raw}))
            self.changed.notify_all()

    async def stream(
        self, request: rendering.Request, items: Callable[[str], list[dict[str, Any]]]
    ) -> aiohttp.web.StreamResponse:
        """Watch with real semantics: from `resourceVersion` if given (no replay), else ADDED for all.

        `items(resource)` lists the objects of a resource as they are now.
        """
        res, ns = request.resource, request.namespace
        selector = request.params.get("labelSelector")
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)

        def wanted(obj: dict[str, Any]) -> bool:
            meta = obj.get("metadata", {})
            return (ns is None or meta.get("namespace") == ns) and (not selector or matches_selector(obj, selector))

        async with self.changed:
            if since and since.isdigit():
                pos = next((i for i in range(len(self.events) - 1, -1, -1) if self.events[i][0] <= int(since)), -1) + 1
                initial = []
            else:
                pos = len(self.events)
                initial = [o for o in items(f"{res.group}/{res.version}/{res.plural}" if res.group
                                            else f"{res.version}/{res.plural}") if wanted(o)]
        for obj in initial:
            await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                async with self.changed:
                    while pos >= len(self.events):
                        left = deadline - asyncio.get_running_loop().time()
                        if left <= 0 or _gone(request._raw_request):
                            return response
                        try:
                            await asyncio.wait_for(self.changed.wait(), timeout=min(left, _DISCONNECT_POLL_S))
                        except asyncio.TimeoutError:
                            pass
                    batch, pos = self.events[pos:], len(self.events)
                for _, r, event in batch:
                    if r == res and wanted(event["object"]):
                        await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            return response


async def watch_unchanging(raw: aiohttp.web.BaseRequest, objects: Mapping[str, dict[str, Any]]) -> aiohttp.web.StreamResponse:
    """A watch of objects that never change: ADDED for each (unless resumed from a version), then quiet."""
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(raw)
    if not raw.query.get("resourceVersion"):
        for obj in list(objects.values()):
            await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
    deadline = asyncio.get_running_loop().time() + float(raw.query.get("timeoutSeconds") or 3600)
    try:
        while asyncio.get_running_loop().time() < deadline and not _gone(raw):
            await asyncio.sleep(_DISCONNECT_POLL_S)
    except asyncio.CancelledError:
        pass
    return response


def _gone(request: aiohttp.web.BaseRequest) -> bool:
    """The client hung up (e.g. a SIGKILLed operator): end its watch, or the server's shutdown waits 60 s."""
    transport = request.transport
    return transport is None or transport.is_closing()

"""Status writes of one pool's reconciler: its LoraAdapters' and the LoraPool's `status`
subresources, merge-patched through the Kubernetes API (no kopf: kopf patches only the object a
handler runs for). A write that fails is logged and left to the next round, which computes the
statuses again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from lorafleet.operator.kube import KubeClient, KubeError, NotFound
from lorafleet.operator.pool_state import AdapterRecord
from lorafleet.operator.spec import API_VERSION

log = logging.getLogger("lorafleet.operator")


async def patch_adapter_statuses(
    kube: KubeClient | None,
    namespace: str,
    adapters: Mapping[str, AdapterRecord],
    writes: list[tuple[AdapterRecord, dict[str, Any]]],
    concurrency: int,
) -> None:
    """Write each new status and remember it on its record (without an API: only remember it)."""
    if kube is None:
        for record, new in writes:
            record.status = new
        return
    sem = asyncio.Semaphore(concurrency)

    async def one(record: AdapterRecord, new: dict[str, Any]) -> None:
        path = KubeClient.path(API_VERSION, "loraadapters", namespace, record.spec.name, "status")
        async with sem:
            try:
                await kube.patch(path, {"status": new})
                record.status = new
                # An upsert during the write (kopf's resume handler on restart, say) replaced the
                # record with one built from the event's older status: the object has `new` all
                # the same, so remember it there too, or the status is never rewritten.
                current = adapters.get(record.spec.name)
                if current is not None and current is not record:
                    current.status = new
            except NotFound:
                pass  # deleted meanwhile
            except (KubeError, OSError) as exc:
                log.warning("status of %s not written: %s", record.spec.name, exc)

    await asyncio.gather(*(one(r, s) for r, s in writes))


async def patch_pool_status(kube: KubeClient, namespace: str, name: str, new: dict[str, Any]) -> bool:
    """Whether the LoraPool's status now is `new`."""
    path = KubeClient.path(API_VERSION, "lorapools", namespace, name, "status")
    try:
        await kube.patch(path, {"status": new})
    except (KubeError, OSError) as exc:
        log.warning("pool status not written: %s", exc)
        return False
    return True

"""The gateway's state: everything a request handler needs, built once in the app's lifespan
(`router/api.py`) and read by the routes (`router/generate.py`, `router/request_fields.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from lorafleet.router.admin_tokens import AdminTokens
from lorafleet.router.decisions import Decider
from lorafleet.router.fleet import Fleet
from lorafleet.router.loader import AdapterLoader
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.placement import PlacementSync
from lorafleet.router.proxy import RetryBudget
from lorafleet.router.ratelimit import RateLimiter
from lorafleet.router.settings import RouterSettings
from lorafleet.router.tenants import TenantRegistry
from lorafleet.router.upstream import Pool


@dataclass(slots=True)
class Gateway:
    """Everything a request handler needs; built in the lifespan, stored on `app.state.gateway`."""

    settings: RouterSettings
    http: httpx.AsyncClient  # control calls: inventory polls, loads, unloads, probes
    upstream: Pool  # proxied requests (router/upstream.py)
    fleet: Fleet
    sync: PlacementSync
    loader: AdapterLoader
    limiter: RateLimiter
    tenants: TenantRegistry
    decider: Decider  # the policy, on the fleet's index where it can (router/decisions.py)
    budget: RetryBudget
    metrics: RouterMetrics
    catalog: dict[str, str]
    metrics_token: AdminTokens  # its file: the token /metrics requires (none: open)

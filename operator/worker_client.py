"""Calls to a worker's admin API: inventory, load, unload, each load/unload verified by inventory.

Never trust a 200: vLLM-style engines have answered 200 to an unload and kept the weights. After
every call the client re-reads `GET /v1/adapters` and reports what is actually resident.

Errors:
  WorkerUnavailable  transport errors, timeouts, 5xx, 401/403 (token mid-rotation), a 409 while
                     requests still run on the adapter's old weights: retry later.
  LoadRefused        4xx other than auth: the adapter itself is bad (traversal, rank, format,
                     409 same name with different content); permanent until the spec changes.
"""

from __future__ import annotations

import re

import httpx

from lorafleet.protocol import (
    REASON_DRAINING,
    REASON_IN_USE,
    AdapterInventory,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from lorafleet.vllm_inventory import parse_vllm_metrics, vllm_inventory

RESIDENT_TIERS = ("gpu", "cpu")


class WorkerError(Exception):
    pass


class WorkerUnavailable(WorkerError):
    """Transient: the worker cannot answer now. `worker_reason` and `detail`: the reason and
    message of the worker's answer, when it gave one."""

    def __init__(self, message: str, worker_reason: str | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.worker_reason = worker_reason
        self.detail = detail


class WorkerBusy(WorkerUnavailable):
    """A 409 that passes once the requests running on the old weights finish (BUSY_REASONS)."""


# The worker's error reasons (worker/lora/fetch.py, worker/server/admin.py) that name their own
# condition reason; any other refusal is LoadRefused, a 409 ContentConflict.
SOURCE_REASONS = {
    "DigestMismatch": "DigestMismatch",
    "not_found": "SourceNotFound",
    "missing_config": "SourceNotFound",
    "missing_weights": "SourceNotFound",
    "access_denied": "SourceAccessDenied",
    "no_credentials": "SourceAccessDenied",
    "unsupported_source": "SourceUnsupported",
    "bad_source": "InvalidSource",
}
# Fetch errors that pass (a network or store hiccup, an object replaced mid-download): retried.
TRANSIENT_REASONS = ("fetch_failed", "changed")
# The worker's reasons for a fetch of a remote source that failed and is worth another try (its
# 503 "unavailable": the store or the Hub kept failing through the worker's own retries): shown in
# the adapter's Ready condition (FetchRetrying) until a load takes.
FETCH_RETRY_REASONS = ("unavailable", *TRANSIENT_REASONS)
FETCH_MESSAGE_MAX = 400
# What a worker's message must not carry into a status: absolute paths of its machine (a path
# after "://" is a source's, kept), credentials in a URL, key-shaped strings.
_REDACT = (
    (re.compile(r"(?<![\w:/.])/[^\s'\",;)]+"), "<path>"),
    (re.compile(r"://[^/\s@]+@"), "://"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|\bhf_[A-Za-z0-9]{16,}\b"), "<redacted>"),
)


def fetch_retry(exc: WorkerError) -> tuple[str, str] | None:
    """(worker reason, safe message) when `exc` is a load whose remote fetch failed transiently."""
    reason = getattr(exc, "worker_reason", None)
    if not isinstance(exc, WorkerUnavailable) or reason not in FETCH_RETRY_REASONS:
        return None
    text = exc.detail
    for pattern, replacement in _REDACT:
        text = pattern.sub(replacement, text)
    if len(text) > FETCH_MESSAGE_MAX:
        text = text[:FETCH_MESSAGE_MAX] + "..."
    return reason, text


class LoadRefused(WorkerError):
    """Permanent for this adapter spec: the worker rejected the adapter."""

    def __init__(self, status: int, message: str, worker_reason: str | None = None) -> None:
        super().__init__(f"worker refused the load ({status}): {message}")
        self.status = status
        self.message = message
        self.worker_reason = worker_reason

    @property
    def reason(self) -> str:
        if self.worker_reason in SOURCE_REASONS:
            return SOURCE_REASONS[self.worker_reason]
        return "ContentConflict" if self.status == 409 else "LoadRefused"


class NotVerified(WorkerError):
    """The call returned success but the inventory disagrees (transient: the next round repairs)."""


def resident(inventory: AdapterInventory) -> set[str]:
    return {a.name for a in inventory.adapters if a.tier in RESIDENT_TIERS}


BUSY_REASONS = (REASON_IN_USE, REASON_DRAINING)


def _error_reason(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("reason") if isinstance(err, dict) else None


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict):
                return str(err.get("message", body))
            return str(body.get("detail", body))
    except ValueError:
        pass
    return response.text[:300]


class WorkerClient:
    """One shared `httpx.AsyncClient` for every worker; the token is per pool, passed per call."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._http = client

    @classmethod
    def create(cls, timeout_s: float = 10.0, max_connections: int = 256) -> WorkerClient:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        return cls(httpx.AsyncClient(timeout=timeout_s, limits=limits))

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, url: str, token: str, json: dict | None = None) -> httpx.Response:
        try:
            response = await self._http.request(
                method, url, json=json, headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as exc:
            raise WorkerUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500 or response.status_code in (401, 403, 408, 429):
            text = _error_text(response)
            raise WorkerUnavailable(f"{method} {url}: {response.status_code} {text}", _error_reason(response), text)
        return response

    async def inventory(self, base_url: str, token: str) -> AdapterInventory:
        response = await self._call("GET", f"{base_url}/v1/adapters", token)
        if response.status_code == 404:  # no /v1/adapters: a stock vLLM server (LoraPool spec.server)
            return await self._vllm_inventory(base_url, token)
        if response.status_code != 200:
            raise WorkerUnavailable(f"inventory {base_url}: {response.status_code}")
        try:
            return AdapterInventory.model_validate(response.json())
        except ValueError as exc:  # JSON or schema: not (yet) a worker of ours on that port
            raise WorkerUnavailable(f"inventory {base_url}: not an adapter inventory: {str(exc)[:200]}") from exc

    async def _vllm_inventory(self, base_url: str, token: str) -> AdapterInventory:
        """What vLLM lists (`lorafleet.vllm_inventory`): its registered adapters are resident."""
        response = await self._call("GET", f"{base_url}/v1/models", token)
        if response.status_code != 200:
            raise WorkerUnavailable(f"inventory {base_url}: no /v1/adapters, /v1/models {response.status_code}")
        try:
            page = await self._http.get(f"{base_url}/metrics")
            metrics = parse_vllm_metrics(page.text) if page.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            metrics = None
        try:
            return vllm_inventory(response.json(), metrics)
        except ValueError as exc:
            raise WorkerUnavailable(f"inventory {base_url}: not a worker: {str(exc)[:200]}") from exc

    async def load(self, base_url: str, token: str, name: str, path: str, inplace: bool = False,
                   sha256: str | None = None) -> AdapterInventory:
        """Load `name` from `path`; `inplace` replaces a copy of other content (a new source or
        sha256), atomically on the worker, once no request runs on the old one. `sha256` pins the
        content: the worker refuses other bytes (DigestMismatch) before serving them."""
        body = LoadLoraAdapterRequest(lora_name=name, lora_path=path, load_inplace=inplace,
                                      sha256=sha256).model_dump(exclude_defaults=True)
        response = await self._call("POST", f"{base_url}/v1/load_lora_adapter", token, body)
        if response.status_code >= 400:
            text = _error_text(response)
            reason = _error_reason(response)
            if response.status_code == 409 and reason in BUSY_REASONS:
                raise WorkerBusy(f"load {name} on {base_url}: {text}")
            if reason in TRANSIENT_REASONS:
                raise WorkerUnavailable(f"load {name} on {base_url}: {text}", reason, text)
            # vLLM answers 400 "already loaded" for a name it holds: the inventory decides.
            if not (response.status_code == 400 and "already" in text.lower()):
                raise LoadRefused(response.status_code, text, reason)
        inventory = await self.inventory(base_url, token)
        if name not in resident(inventory):
            raise NotVerified(f"{name} not resident on {base_url} after a successful load")
        return inventory

    async def unload(self, base_url: str, token: str, name: str) -> AdapterInventory:
        body = UnloadLoraAdapterRequest(lora_name=name).model_dump(exclude_none=True)
        response = await self._call("POST", f"{base_url}/v1/unload_lora_adapter", token, body)
        if response.status_code >= 400 and response.status_code != 404:
            raise WorkerUnavailable(f"unload {name} on {base_url}: {response.status_code} {_error_text(response)}")
        inventory = await self.inventory(base_url, token)
        if name in resident(inventory):
            raise NotVerified(f"{name} still resident on {base_url} after unload answered {response.status_code}")
        return inventory

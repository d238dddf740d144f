"""Worker kinds: how the router reads and drives a lorafleet worker or a stock vLLM server.

Both kinds end up as the same `AdapterInventory`, so the scheduler, filters and scorers do not know
which kind a replica is. What differs, and lives here:

- inventory: `GET /v1/adapters` (lorafleet) or `GET /v1/models` + `GET /metrics` (vLLM, see
  `lorafleet.vllm_inventory`);
- detection: a replica declared `vllm=URL` / `lorafleet=URL` (or by its pod's label) is that kind;
  one given as a bare URL is probed until it tells (`/v1/adapters` answers an inventory: lorafleet;
  it is 404 and `/v1/models` lists a base model: vLLM; any other answer: asked again next poll) and
  the answer is remembered;
- requests: vLLM's `--api-key` guards `/v1/*`, generation included, so requests to a vLLM replica
  carry the pool's token; a request naming one adapter through `lora_adapters` at scale 1 is sent
  to vLLM as `model: <adapter>` (vLLM has no `lora_adapters`); other compositions go to our workers;
- unloads: vLLM's 200 is not proof (its engine may keep the adapter): an unload counts once
  `/v1/models` no longer lists the adapter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import httpx

from lorafleet.protocol import AdapterInventory
from lorafleet.vllm_inventory import VllmLimits, parse_vllm_metrics, registered_adapters, vllm_inventory

Kind = Literal["lorafleet", "vllm"]
KINDS: tuple[Kind, ...] = ("lorafleet", "vllm")


class NotAWorker(ValueError):
    """The URL answered, but as neither kind."""


async def fetch_inventory(http: httpx.AsyncClient, kind: Kind, admin_url: str, headers: Mapping[str, str],
                          limits: VllmLimits = VllmLimits(), timeout: float = 2.0) -> AdapterInventory:
    """The replica's inventory; raises httpx.HTTPError or ValueError as a poll failure."""
    if kind == "lorafleet":
        resp = await http.get(f"{admin_url}/v1/adapters", headers=dict(headers), timeout=timeout)
        resp.raise_for_status()
        return AdapterInventory.model_validate(resp.json())
    resp = await http.get(f"{admin_url}/v1/models", headers=dict(headers), timeout=timeout)
    resp.raise_for_status()
    models = resp.json()
    try:  # /metrics is unauthenticated on vLLM; without it: residency from /v1/models alone
        page = await http.get(f"{admin_url}/metrics", timeout=timeout)
        metrics = parse_vllm_metrics(page.text) if page.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        metrics = None
    return vllm_inventory(models, metrics, limits)


async def detect_kind(http: httpx.AsyncClient, admin_url: str, headers: Mapping[str, str],
                      timeout: float = 2.0) -> Kind:
    """Probe a replica given as a bare URL. Raises httpx.HTTPError when it does not answer, NotAWorker
    when it answers as neither kind."""
    resp = await http.get(f"{admin_url}/v1/adapters", headers=dict(headers), timeout=timeout)
    if resp.status_code == 200:
        try:
            AdapterInventory.model_validate(resp.json())
            return "lorafleet"
        except ValueError:
            pass
    elif resp.status_code != 404:
        # 401/403 (a token not yet mounted or rotating), 5xx: our worker may be behind it, and its
        # public /v1/models looks like vLLM's. Decide on a later poll, never on this answer.
        raise NotAWorker(f"{admin_url}/v1/adapters answered HTTP {resp.status_code}: kind not known yet")
    resp = await http.get(f"{admin_url}/v1/models", headers=dict(headers), timeout=timeout)
    if resp.status_code == 200:
        try:
            registered_adapters(resp.json())
            return "vllm"
        except ValueError:
            pass
    raise NotAWorker(f"{admin_url}: neither /v1/adapters (lorafleet) nor /v1/models (vLLM) answered as a worker "
                     f"(last: HTTP {resp.status_code})")


async def still_listed(http: httpx.AsyncClient, admin_url: str, headers: Mapping[str, str], adapter: str) -> bool:
    """Whether vLLM's /v1/models still lists `adapter` (True when it cannot tell)."""
    try:
        resp = await http.get(f"{admin_url}/v1/models", headers=dict(headers), timeout=5.0)
        resp.raise_for_status()
        return adapter in registered_adapters(resp.json())[1]
    except (httpx.HTTPError, ValueError):
        return True


def request_headers(kind: Kind | None, token_headers: Mapping[str, str]) -> dict[str, str]:
    """Headers a proxied request to this replica adds: vLLM's API key (the pool's token)."""
    return dict(token_headers) if kind == "vllm" else {}


def request_body(kind: Kind | None, payload: dict[str, Any], body: bytes, adapters: tuple[str, ...]) -> bytes:
    """The body sent to this replica: for vLLM, one adapter named in `lora_adapters` becomes `model`."""
    if kind != "vllm" or "lora_adapters" not in payload:
        return body
    out = {k: v for k, v in payload.items() if k != "lora_adapters"}
    if adapters:
        out["model"] = adapters[0]
    return json.dumps(out).encode()


def vllm_can_serve(payload: Mapping[str, Any]) -> bool:
    """Whether a vLLM server takes this request's adapters: one adapter at scale 1 (or none)."""
    refs = payload.get("lora_adapters")
    if not refs:
        return True
    if not isinstance(refs, list) or len(refs) != 1 or not isinstance(refs[0], dict):
        return False
    scale = refs[0].get("scale")
    return scale is None or scale == 1


def replicas_of_kind(replicas: Iterable[Any], kind: Kind) -> set[str]:
    return {r.name for r in replicas if getattr(r, "kind", None) == kind}

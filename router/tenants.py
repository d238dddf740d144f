"""Tenants: API keys (stored as SHA-256 hashes) → tenant → the adapters and base models it may use.

File format (YAML or JSON; on Kubernetes mount it from a Secret):

    tenants:
      - name: acme
        api_key_sha256: ["9f86d0…"]          # `lorafleet router --hash-api-key < key.txt`
        adapters: [acme-support, acme-sql]  # "*" or omitted: every adapter
        models: [llama-8b]                  # base models; "*" or omitted: every base model
        max_concurrency: 32                 # optional; enforced through Redis (see ratelimit.py)
        requests_per_minute: 600            # optional

Keys are compared by hash lookup; the plain key never sits in the file or in memory past the
request. With no file the router runs open: one anonymous tenant that may use everything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    adapters: frozenset[str] | None = None  # None: any
    models: frozenset[str] | None = None  # None: any
    max_concurrency: int | None = None
    requests_per_minute: int | None = None
    # What /metrics shows for this tenant when the scrape is not authenticated: an opaque id,
    # stable while the tenant's keys are (see `metric_label`).
    label: str = ""

    def may_use_adapter(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters

    def may_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Tenant("anonymous", label="anonymous")


def metric_label(name: str, key_hashes: list[str]) -> str:
    """`t-` and 12 hex digits of HMAC(key hashes, name): the name cannot be guessed back from it
    (the key hashes are secret), and the series survive a restart. `lorafleet router
    --tenants-file F --tenant-labels` prints the mapping for operators."""
    key = "".join(sorted(key_hashes)).encode()
    return "t-" + hmac.new(key, name.encode(), hashlib.sha256).hexdigest()[:12]


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.strip().encode()).hexdigest()


def _names(value: object) -> frozenset[str] | None:
    if value is None or value == "*" or value == ["*"]:
        return None
    if isinstance(value, str):
        return frozenset([value])
    return frozenset(str(v) for v in value)  # type: ignore[union-attr]


@dataclass(frozen=True, slots=True)
class TenantRegistry:
    by_key_hash: Mapping[str, Tenant]
    open: bool = False

    @classmethod
    def open_mode(cls) -> TenantRegistry:
        return cls({}, open=True)

    @classmethod
    def parse(cls, doc: Mapping) -> TenantRegistry:
        by_hash: dict[str, Tenant] = {}
        for entry in doc.get("tenants", []):
            tenant = Tenant(
                name=str(entry["name"]),
                adapters=_names(entry.get("adapters")),
                models=_names(entry.get("models")),
                max_concurrency=entry.get("max_concurrency"),
                requests_per_minute=entry.get("requests_per_minute"),
            )
            hashes = entry.get("api_key_sha256", [])
            hashes = [str(h).lower().removeprefix("sha256:") for h in ([hashes] if isinstance(hashes, str) else hashes)]
            tenant = replace(tenant, label=metric_label(tenant.name, hashes))
            for h in hashes:
                if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                    raise ValueError(f"tenant {tenant.name!r}: api_key_sha256 must be 64 hex digits")
                if h in by_hash:
                    raise ValueError(f"tenant {tenant.name!r}: a key hash is shared with {by_hash[h].name!r}")
                by_hash[h] = tenant
        return cls(by_hash)

    def labels(self) -> dict[str, str]:
        """Tenant name -> its /metrics label."""
        return {t.name: t.label for t in self.by_key_hash.values()}

    @classmethod
    def from_file(cls, path: Path) -> TenantRegistry:
        text = path.read_text()
        if path.suffix == ".json":
            return cls.parse(json.loads(text))
        import yaml

        return cls.parse(yaml.safe_load(text) or {})

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """`Authorization: Bearer KEY` → tenant, or None (→ 401). Open mode: always the anonymous tenant."""
        if self.open:
            return ANONYMOUS
        if not authorization or not authorization[:7].lower() == "bearer ":
            return None
        key = authorization[7:].strip()
        if not key:
            return None
        return self.by_key_hash.get(hash_api_key(key))

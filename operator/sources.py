"""Remote adapter sources on Kubernetes: which `spec.source` forms a LoraAdapter may name, which
ones a LoraPool allows (`spec.sources`), and how the pool's fetch credentials reach its workers.

| `spec.source` | meaning |
|---|---|
| `sql`, `team/sql` | a folder on the pool's adapter volume (relative, no `..`) |
| `s3://BUCKET/PREFIX` | the objects under PREFIX/ of an S3 or S3-compatible bucket |
| `hf://OWNER/NAME[/SUBFOLDER...][@REVISION]` | a Hugging Face Hub repo (or a subfolder of it) |

The CRD refuses other forms with the same regular expressions (crds/loraadapters.lorafleet.dev.yaml,
checked against these in tests/operator/test_sources.py).

The pool's `spec.sources`:

    sources:
      credentialsSecretRef: {name: adapter-store}   # keys: CREDENTIAL_KEYS, each optional
      allowedBuckets: [team-adapters]               # s3:// buckets ("*": any)
      allowedHubOwners: [my-org]                    # hf:// owners ("*": any)
      cacheBytes: 21474836480                       # the workers' fetch cache (an emptyDir)
      nodeCache: {hostPath: /var/cache/lorafleet-adapters}   # optional: one cache per node instead

Without `nodeCache` each worker has its own cache, an emptyDir (Pod Security `restricted` admits
it). With it, the cache is that folder of the node (a hostPath volume, DirectoryOrCreate), shared by
every worker scheduled there: one download per node and content (the workers lock it between
them, worker/lora/cache_locks.py), kept across pod restarts. Pod Security `restricted` and
`baseline` both refuse hostPath volumes: the pool's namespace must be `privileged`, and the folder
must be writable by the workers' user (uid WORKER_UID in builders.py), which a DirectoryOrCreate
folder made by the kubelet (root, 0755) is not.

Without `spec.sources` a pool serves volume adapters only: a remote source is refused
(SourceNotAllowed) before any load, and its pods are as they were. The operator never reads a
Secret: the pool's Secret is referenced by the worker container's env (`secretKeyRef`, one variable
per standard key, each optional), so its values reach only the worker process, where boto3 and
huggingface_hub read them. A worker has one credential chain, so a LoraAdapter's own
`credentialsSecretRef` must name the pool's Secret (CredentialsNotOnPool otherwise): adding a Secret
per adapter would change the pod template, restarting every worker of the pool.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The standard variable names the pool's Secret may hold (boto3's and huggingface_hub's own).
CREDENTIAL_KEYS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "HF_TOKEN", "HF_ENDPOINT",
)
CACHE_VOLUME = "adapter-cache"
CACHE_MOUNT = "/var/cache/lorafleet/adapters"
DEFAULT_CACHE_BYTES = 20 << 30

# The CRD's CEL rules use these same expressions (RE2 and Python's re agree on them).
SCHEME = r"^[A-Za-z][A-Za-z0-9+.-]*://"
S3_SOURCE = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^?#]*)?$"
HF_SOURCE = r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(/[^@/][^@]*)?(@[A-Za-z0-9][A-Za-z0-9._/-]*)?$"
ALLOWED_FORMS = "a path on the pool's adapter volume, s3://BUCKET/PREFIX or hf://OWNER/NAME[/SUBFOLDER][@REVISION]"


class InvalidSource(ValueError):
    """A source or a pool's `spec.sources` the operator refuses; `reason` is the condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SourcesSpec:
    """A LoraPool's `spec.sources`; `enabled` is False when the field is absent."""

    enabled: bool = False
    credentials_secret: str | None = None
    allowed_buckets: tuple[str, ...] = ()
    allowed_hub_owners: tuple[str, ...] = ()
    cache_bytes: int = DEFAULT_CACHE_BYTES
    node_cache: str | None = None  # a node folder (hostPath) shared by the node's workers; None: an emptyDir


def scheme_of(source: str) -> str | None:
    """"s3", "hf", another scheme (lower case), or None for a volume path."""
    match = re.match(SCHEME, source)
    return match.group(0)[:-3].lower() if match else None


def is_remote(source: str) -> bool:
    return scheme_of(source) is not None


def check_source(source: str) -> None:
    """The CRD's rules on `spec.source`, for objects a lax API server let through."""
    scheme = scheme_of(source)
    if scheme is None:
        if source.startswith("/") or ".." in source.split("/"):
            raise InvalidSource("SourceOutsideVolume",
                                f"source {source!r} must be relative to the adapter volume, without '..'")
        return
    if scheme not in ("s3", "hf"):
        raise InvalidSource("InvalidSource", f"source {source!r}: scheme {scheme!r} is not supported; use {ALLOWED_FORMS}")
    pattern = S3_SOURCE if scheme == "s3" else HF_SOURCE
    if not re.match(pattern, source) or ".." in source.split("/"):
        raise InvalidSource("InvalidSource", f"source {source!r} is malformed; use {ALLOWED_FORMS}")


def _names(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise InvalidSource("InvalidSpec", f"spec.sources.{key} must be a list of names")
    return tuple(value)


def secret_name(raw: Any, where: str) -> str | None:
    """A `credentialsSecretRef` ({name: ...}) as the Secret's name."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise InvalidSource("InvalidSpec", f"{where}credentialsSecretRef must be {{name: <Secret name>}}")
    return raw["name"]


def parse_sources(spec: Mapping[str, Any]) -> SourcesSpec:
    raw = spec.get("sources")
    if raw is None:
        return SourcesSpec()
    if not isinstance(raw, Mapping):
        raise InvalidSource("InvalidSpec", "spec.sources must be an object")
    cache = raw.get("cacheBytes", DEFAULT_CACHE_BYTES)
    if isinstance(cache, bool) or not isinstance(cache, int) or cache < 1 << 20:
        raise InvalidSource("InvalidSpec", f"spec.sources.cacheBytes must be an integer >= 1048576, not {cache!r}")
    return SourcesSpec(
        enabled=True,
        node_cache=node_cache_path(raw.get("nodeCache")),
        credentials_secret=secret_name(raw.get("credentialsSecretRef"), "spec.sources."),
        allowed_buckets=_names(raw, "allowedBuckets"),
        allowed_hub_owners=_names(raw, "allowedHubOwners"),
        cache_bytes=cache,
    )


def node_cache_path(raw: Any) -> str | None:
    """`spec.sources.nodeCache` ({hostPath: /absolute/folder}) as the folder, None when absent."""
    if raw is None:
        return None
    path = raw.get("hostPath") if isinstance(raw, Mapping) else None
    if not isinstance(path, str) or not path.startswith("/") or path.rstrip("/") == "" or ".." in path.split("/"):
        raise InvalidSource("InvalidSpec", "spec.sources.nodeCache must be {hostPath: <absolute folder of the node, "
                            f"not '/', without '..'>}}, not {raw!r}")
    return path.rstrip("/")


def _allowed(value: str, allowed: tuple[str, ...]) -> bool:
    return "*" in allowed or value in allowed


def check_policy(source: str, credentials: str | None, pool_name: str, sources: SourcesSpec, server_kind: str) -> None:
    """Whether pool `pool_name` may fetch `source`; raised before any load (InvalidSource)."""
    scheme = scheme_of(source)
    if credentials is not None and credentials != sources.credentials_secret:
        on_pool = f"Secret {sources.credentials_secret!r}" if sources.credentials_secret else "no Secret"
        raise InvalidSource(
            "CredentialsNotOnPool",
            f"credentialsSecretRef {credentials!r} is not the Secret pool {pool_name}'s workers fetch with "
            f"(spec.sources.credentialsSecretRef: {on_pool}); a worker has one credential chain: set it on the pool",
        )
    if scheme is None:
        return
    if server_kind != "lorafleet":
        raise InvalidSource("SourceUnsupported",
                            f"pool {pool_name} runs stock vLLM, which loads adapters from its volume only, not {scheme}://")
    rest = source.split("://", 1)[1]
    if scheme == "s3":
        what, value, allowed, field = "bucket", rest.split("/", 1)[0], sources.allowed_buckets, "allowedBuckets"
    else:
        what, value, allowed, field = "Hub owner", rest.split("/", 1)[0], sources.allowed_hub_owners, "allowedHubOwners"
    if not _allowed(value, allowed):
        listed = ", ".join(allowed) if allowed else "none" if sources.enabled else "none (no spec.sources)"
        raise InvalidSource("SourceNotAllowed",
                            f"{what} {value!r} is not allowed on pool {pool_name} (spec.sources.{field}: {listed})")


def worker_env(sources: SourcesSpec, cache_dir: str = CACHE_MOUNT) -> list[dict[str, Any]]:
    """The worker container's env for remote sources: the cache, and each standard key of the
    pool's Secret (optional: a key the Secret lacks is simply unset; the values never pass the operator)."""
    if not sources.enabled:
        return []
    env: list[dict[str, Any]] = [
        {"name": "LORAFLEET_ADAPTER_CACHE_DIR", "value": cache_dir},
        {"name": "LORAFLEET_ADAPTER_CACHE_BYTES", "value": str(sources.cache_bytes)},
    ]
    if sources.credentials_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": sources.credentials_secret, "key": key,
                                                              "optional": True}}} for key in CREDENTIAL_KEYS]
    return env


def cache_volume(sources: SourcesSpec) -> dict[str, Any] | None:
    """The fetch cache: the node's folder with `nodeCache` (a hostPath, created if missing; its
    workers evict at the byte bound), else an emptyDir sized a little above the bound."""
    if not sources.enabled:
        return None
    if sources.node_cache:
        return {"name": CACHE_VOLUME, "hostPath": {"path": sources.node_cache, "type": "DirectoryOrCreate"}}
    limit = sources.cache_bytes + sources.cache_bytes // 10
    return {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": str(limit)}}


def load_pin(spec_sha256: str | None, source: str, target_digest: str | None, server_kind: str) -> str | None:
    """The `sha256` the operator sends with a load of an adapter's target content.

    The spec's sha256 when it has one; for a remote source without one, the digest the first load
    reported (`target_digest`, kept in status.digest), so that an object changed after that load is
    refused by every later replica (DigestMismatch) instead of served under the old name. A volume
    folder without sha256 follows its files, as the pool's volume is the operator's to trust. Never
    for stock vLLM, which reports no digests."""
    if server_kind != "lorafleet" or not target_digest:
        return None
    if spec_sha256 is None and not is_remote(source):
        return None
    return target_digest.lower().removeprefix("sha256:")

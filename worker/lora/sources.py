"""Where an adapter comes from: `lora_path` (and a LoraAdapter's `spec.source`) parsed into a source.

| form | meaning |
|---|---|
| a path (`/adapters/sql`, `sql`) | a folder on a volume the worker mounts (confined to `--adapter-root`) |
| `s3://BUCKET/PREFIX` | the objects under `PREFIX/` in an S3 or S3-compatible bucket (fetch.py) |
| `hf://OWNER/NAME[@REVISION]` | a Hugging Face Hub repo, optionally pinned to a revision (parsed; not fetched yet) |

Any other `scheme://` is refused with a message naming these. Parsing touches no network or disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lorafleet.worker.lora.errors import AdapterError

SCHEMES = ("s3", "hf")
ALLOWED = "a local path, s3://BUCKET/PREFIX or hf://OWNER/NAME[@REVISION]"

# S3's bucket naming rules (3-63 characters, lower case, digits, dots, hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
# The Hub's repo id rules: OWNER/NAME of letters, digits, '-', '_', '.'.
_HUB_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,95}$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


@dataclass(frozen=True, slots=True)
class LocalSource:
    path: str

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True, slots=True)
class S3Source:
    bucket: str
    prefix: str  # no leading slash; ends with "/" unless empty (the whole bucket)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True, slots=True)
class HubSource:
    repo_id: str  # OWNER/NAME
    revision: str | None  # a branch, tag or commit; None: the repo's default branch

    def __str__(self) -> str:
        return f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


Source = LocalSource | S3Source | HubSource


def bad_source(message: str) -> AdapterError:
    return AdapterError("bad_source", message)


def parse_source(text: str) -> Source:
    """Parse `lora_path`; AdapterError "bad_source" for an unknown scheme or a malformed URL."""
    match = _SCHEME.match(text)
    if match is None:
        return LocalSource(text)
    scheme = match.group(1).lower()
    rest = text[match.end():]
    if scheme == "s3":
        return _parse_s3(text, rest)
    if scheme == "hf":
        return _parse_hub(text, rest)
    raise bad_source(f"adapter source {text!r}: scheme {scheme!r} is not supported; use {ALLOWED}")


def _parse_s3(text: str, rest: str) -> S3Source:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise bad_source(f"adapter source {text!r}: {bucket!r} is not a valid S3 bucket name")
    if "?" in prefix or "#" in prefix or "\0" in prefix:
        raise bad_source(f"adapter source {text!r}: the prefix may not hold '?', '#' or NUL")
    if any(part in (".", "..") for part in prefix.split("/")):
        raise bad_source(f"adapter source {text!r}: the prefix may not hold '.' or '..' segments")
    prefix = prefix.strip("/")
    return S3Source(bucket, prefix + "/" if prefix else "")


def _parse_hub(text: str, rest: str) -> HubSource:
    repo, at, revision = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_HUB_PART.match(p) for p in parts) or any(".." in p for p in parts):
        raise bad_source(f"adapter source {text!r}: expected hf://OWNER/NAME[@REVISION]")
    if at and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$", revision):
        raise bad_source(f"adapter source {text!r}: {revision!r} is not a valid revision")
    return HubSource(repo, revision if at else None)

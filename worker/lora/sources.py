"""Where an adapter comes from: `lora_path` (and a LoraAdapter's `spec.source`) parsed into a source.

| form | meaning |
|---|---|
| a path (`/adapters/sql`, `sql`) | a folder on a volume the worker mounts (confined to `--adapter-root`) |
| `s3://BUCKET/PREFIX` | the objects under `PREFIX/` in an S3 or S3-compatible bucket (fetch.py) |
| `hf://OWNER/NAME[/SUBFOLDER][@REVISION]` | a Hugging Face Hub model repo (or a folder in it) at a branch, tag or commit (hub_fetch.py) |

`hf://acme/loras/sql/v2@3f2a…` is the folder `sql/v2` of the repo `acme/loras` at that commit; without
`@REVISION` the repo's default branch, resolved to its commit when fetched. The revision follows the
first `@` and may hold `/` (`@refs/pr/3`); repo and folder names may not hold `@`.

Any other `scheme://` is refused with a message naming these. Parsing touches no network or disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lorafleet.worker.lora.errors import AdapterError

SCHEMES = ("s3", "hf")
ALLOWED = "a local path, s3://BUCKET/PREFIX or hf://OWNER/NAME[/SUBFOLDER][@REVISION]"

# S3's bucket naming rules (3-63 characters, lower case, digits, dots, hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
# The Hub's repo id rules: OWNER/NAME of letters, digits, '-', '_', '.'.
_HUB_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,95}$")
# A folder in a repo: segments of letters, digits, '-', '_', '.' (no '.' or '..' segment).
_HUB_FOLDER_PART = re.compile(r"^[A-Za-z0-9._\-]{1,255}$")
# Branches, tags ("v1.0"), commits (40 hex digits) and refs ("refs/pr/3").
_HUB_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")
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
    subfolder: str = ""  # a folder in the repo ("a/b", no slashes around it); "": the repo's root

    def __str__(self) -> str:
        folder = f"/{self.subfolder}" if self.subfolder else ""
        return f"hf://{self.repo_id}{folder}" + (f"@{self.revision}" if self.revision else "")


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
    path, at, revision = rest.partition("@")
    parts = path.rstrip("/").split("/")
    owner_name, folder = parts[:2], parts[2:]
    if len(owner_name) != 2 or not all(_HUB_PART.match(p) for p in owner_name) or any(".." in p for p in owner_name):
        raise bad_source(f"adapter source {text!r}: expected hf://OWNER/NAME[/SUBFOLDER][@REVISION]")
    if not all(_HUB_FOLDER_PART.match(p) and p not in (".", "..") for p in folder):
        raise bad_source(f"adapter source {text!r}: the folder may hold letters, digits, '-', '_' and '.' "
                         "between slashes, and no '.' or '..' segments")
    if at and (not _HUB_REVISION.match(revision) or ".." in revision or revision.endswith("/")):
        raise bad_source(f"adapter source {text!r}: {revision!r} is not a valid revision")
    return HubSource("/".join(owner_name), revision if at else None, "/".join(folder))

"""What every remote adapter source shares: the two files a backend resolves a source into, the
caps they are checked against before any download, and the error worth retrying."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lorafleet.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.worker.lora.adapter_files import MAX_CONFIG_BYTES
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.sources import HubSource, S3Source

PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

RemoteSource = S3Source | HubSource


class TransientError(AdapterError):
    """A failure worth retrying: a 5xx or 429 answer, a reset connection, a timeout."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


@dataclass(frozen=True, slots=True)
class RemoteFile:
    name: str  # CONFIG_FILE or WEIGHTS_FILE
    size: int
    ref: Any  # the backend's handle: S3 key and ETag, Hub path and blob id


@dataclass(frozen=True, slots=True)
class Resolved:
    """A source pinned to one content: what the cache folder is named after, and its two files."""

    identity: str  # a hash of the content's identity (ETags, commit and blob ids): the cache folder
    config: RemoteFile
    weights: RemoteFile
    commit: str | None = None  # the Hub's commit the revision resolved to


class Backend(Protocol):
    scheme: str

    def resolve(self, source: Any, max_bytes: int) -> Resolved: ...

    def download(self, source: Any, resolved: Resolved, file: RemoteFile, dest: Path) -> None: ...


def pick_files(source: RemoteSource, listed: dict[str, tuple[int, Any]], max_bytes: int) -> tuple[RemoteFile, RemoteFile]:
    """The config and weights among the files directly in the source's folder (name -> (size, ref)),
    checked against the caps before anything is downloaded (the reasons local folders get)."""
    if CONFIG_FILE not in listed:
        raise AdapterError("missing_config", f"adapter source {source} has no {CONFIG_FILE}: not a PEFT adapter")
    if WEIGHTS_FILE not in listed:
        pickled = [n for n in PICKLE_NAMES if n in listed]
        if pickled:
            raise AdapterError("pickle", f"adapter source {source}: {pickled[0]} is a pickle; only {WEIGHTS_FILE} "
                               "is accepted (pickles can run code)")
        raise AdapterError("missing_weights", f"adapter source {source} has no {WEIGHTS_FILE}")
    config, weights = RemoteFile(CONFIG_FILE, *listed[CONFIG_FILE]), RemoteFile(WEIGHTS_FILE, *listed[WEIGHTS_FILE])
    if config.size > MAX_CONFIG_BYTES:
        raise AdapterError("too_large", f"{CONFIG_FILE} is {config.size} bytes, over the {MAX_CONFIG_BYTES}-byte cap")
    if weights.size > max_bytes:
        raise AdapterError("too_large", f"adapter weights are {weights.size} bytes, over the {max_bytes}-byte cap")
    return config, weights

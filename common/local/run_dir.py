"""The run directory of a local fleet (`.lorafleet/` by default): how `lorafleet up` and
`lorafleet adapters` talk to each other without a Kubernetes API server.

    state.json        written by `up` when the fleet is ready: pid, router and worker URLs, pool
    admin-token       the workers' generated admin bearer token (mode 0600)
    adapters/         the local adapter volume: a LoraAdapter's `spec.source` is relative to it
    desired/NAME.json applied LoraAdapter specs (written by `adapters apply`, read by `up`)
    status.json       each adapter's status as the operator's reconciler computes it (written by `up`)
    logs/             one log per worker
    adapter-cache/N/  worker N's cache of adapters fetched from s3:// and hf:// sources (its emptyDir)

`desired/` plays the API server's part: `adapters apply` writes specs with a generation, `up`
reconciles them and publishes status with the observed generation, which `apply` waits for.
Every write is atomic (temp file + rename) so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_RUN_DIR = Path(".lorafleet")


class NotRunning(RuntimeError):
    """No local fleet is running in this run directory."""


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    name: str  # the replica name the router and the placement use (host:port)
    url: str
    pid: int
    log: str


@dataclass(frozen=True, slots=True)
class FleetState:
    pid: int
    router_url: str
    model: str
    pool: str
    device: str
    store: str  # "redis://..." or "embedded"
    adapter_root: str
    workers: tuple[WorkerEntry, ...]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["workers"] = [asdict(w) for w in self.workers]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetState:
        workers = tuple(WorkerEntry(**w) for w in data.get("workers", ()))
        return cls(**{**data, "workers": workers})


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def token_file(self) -> Path:
        return self.root / "admin-token"

    @property
    def adapters(self) -> Path:
        return self.root / "adapters"

    @property
    def desired(self) -> Path:
        return self.root / "desired"

    @property
    def status_file(self) -> Path:
        return self.root / "status.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def adapter_cache(self) -> Path:
        return self.root / "adapter-cache"

    def create(self) -> None:
        for folder in (self.root, self.adapters, self.desired, self.logs):
            folder.mkdir(parents=True, exist_ok=True)

    def new_token(self) -> str:
        """A fresh admin token per run, readable by this user only."""
        token = secrets.token_urlsafe(32)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token

    # ---- state --------------------------------------------------------------------------------

    def write_state(self, state: FleetState) -> None:
        write_json(self.state_file, state.to_json())

    def read_state(self) -> FleetState:
        try:
            return FleetState.from_json(read_json(self.state_file))
        except FileNotFoundError:
            raise NotRunning(f"no local fleet in {self.root}: start one with `lorafleet up`") from None

    def clear_runtime(self) -> None:
        """Forget what a previous run left (state, status, applied adapters); keep adapters/ and logs/."""
        for path in (self.state_file, self.status_file):
            path.unlink(missing_ok=True)
        for path in self.desired.glob("*.json"):
            path.unlink(missing_ok=True)

    # ---- desired adapters (the "API server") ---------------------------------------------------

    def desired_path(self, name: str) -> Path:
        return self.desired / f"{name}.json"

    def read_desired(self) -> dict[str, dict[str, Any]]:
        """name -> {"spec": {...}, "generation": int, "creationTimestamp": str} for every applied adapter."""
        out: dict[str, dict[str, Any]] = {}
        for path in sorted(self.desired.glob("*.json")):
            try:
                out[path.stem] = read_json(path)
            except (OSError, ValueError):
                continue  # removed or being replaced right now: the next poll sees it
        return out

    def write_desired(self, name: str, spec: dict[str, Any], generation: int,
                      created: str | None = None, uid: str | None = None) -> dict[str, Any]:
        """Writes and returns the entry; `created` (RFC 3339) and `uid` are kept across updates, new
        when the object is: as in Kubernetes, an adapter deleted and applied again is another object
        (its own uid), whose status is not the old one's even at the same generation."""
        entry = {"spec": spec, "generation": generation,
                 "creationTimestamp": created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "uid": uid or secrets.token_hex(8)}
        write_json(self.desired_path(name), entry)
        return entry

    def delete_desired(self, name: str) -> bool:
        try:
            self.desired_path(name).unlink()
        except FileNotFoundError:
            return False
        return True

    # ---- status -------------------------------------------------------------------------------

    def write_status(self, statuses: dict[str, Any]) -> None:
        write_json(self.status_file, statuses)

    def read_status(self) -> dict[str, Any]:
        try:
            return read_json(self.status_file)
        except (FileNotFoundError, ValueError):
            return {}

"""A local fleet's adapters as Kubernetes objects: one deleted and applied again is a new object
(not shown the old one's status), and a Failed one applied again is retried."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lorafleet.local.adapters_cli import main
from lorafleet.local.controller import LocalController
from lorafleet.local.run_dir import FleetState, RunDir
from tests.common.test_local_fleet_cli import FAILED_STATUS, READY_STATUS, manifest

SPEC = {"pool": "local", "source": "sql", "replicas": {"min": 1, "max": 1}, "pinned": False}


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    rd = RunDir(tmp_path / ".lorafleet")
    rd.create()
    rd.write_state(FleetState(pid=os.getpid(), router_url="http://127.0.0.1:9", model="tiny", pool="local",
                              device="cpu", store="embedded", adapter_root=str(rd.adapters), workers=()))
    (rd.adapters / "sql").mkdir()
    (rd.adapters / "sql" / "adapter_config.json").write_text("{}")
    return rd


def run(run_dir: RunDir, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(list(args) + ["--run-dir", str(run_dir.root)])
    out, err = capsys.readouterr()
    return code, out, err


def report(run_dir: RunDir, status: dict[str, Any]) -> None:
    """What the fleet's controller writes for the object now in desired/."""
    entry = run_dir.read_desired()["sql"]
    run_dir.write_status({"sql": {"generation": entry["generation"], "spec": entry["spec"], "status": status,
                                  "uid": entry["uid"]}})


def test_delete_and_apply_again_does_not_show_the_old_status(run_dir, capsys, tmp_path):
    path = tmp_path / "sql.yaml"
    path.write_text(manifest("sql"))
    assert run(run_dir, capsys, "apply", "-f", str(path), "--wait", "0")[0] == 0
    report(run_dir, FAILED_STATUS)  # generation 1, Failed
    assert run(run_dir, capsys, "delete", "sql")[0] == 0
    # Applied again before the fleet noticed the deletion: generation 1 again, status.json still
    # holds the old object's entry at generation 1.
    code, out, err = run(run_dir, capsys, "apply", "-f", str(path), "--wait", "1")
    assert "created" in out
    assert "Failed" not in err and "not Ready after 1s (phase Pending)" in err, err
    code, out, _ = run(run_dir, capsys, "get", "sql")
    assert "Failed" not in out and "Pending" in out


def test_apply_again_over_failed_retries(run_dir, capsys, tmp_path):
    path = tmp_path / "sql.yaml"
    path.write_text(manifest("sql"))
    run(run_dir, capsys, "apply", "-f", str(path), "--wait", "0")
    uid = run_dir.read_desired()["sql"]["uid"]
    report(run_dir, FAILED_STATUS)
    code, out, _ = run(run_dir, capsys, "apply", "-f", str(path), "--wait", "0")
    assert "retry" in out
    entry = run_dir.read_desired()["sql"]
    assert entry["generation"] == 2 and entry["uid"] == uid  # the same object, a new generation
    report(run_dir, {**READY_STATUS, "observedGeneration": 2})
    code, out, _ = run(run_dir, capsys, "apply", "-f", str(path), "--wait", "0")
    assert "unchanged" in out and run_dir.read_desired()["sql"]["generation"] == 2  # a Ready one is left alone


@dataclass
class Record:
    spec: Any
    generation: int
    failure: tuple[str, str] | None = None
    status: dict[str, Any] | None = None


@dataclass
class FakeReconciler:
    """The calls the controller makes on the operator's reconciler, recorded."""

    adapters: dict[str, Record] = field(default_factory=dict)
    calls: list[tuple[str, str, int | None]] = field(default_factory=list)

    def upsert_adapter(self, spec, generation, _status) -> None:
        old = self.adapters.get(spec.name)
        record = Record(spec, generation)
        if old is not None and old.spec == spec:
            record.failure = old.failure  # the reconciler's own carry-over (AdapterRecord.succeed)
        self.adapters[spec.name] = record
        self.calls.append(("upsert", spec.name, generation))

    def forget_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.calls.append(("forget", name, None))

    async def unload_everywhere(self, name: str) -> list[str]:
        self.forget_adapter(name)
        return []


async def test_controller_judges_a_new_object_and_a_retry_afresh(run_dir):
    rec = FakeReconciler()
    ctl = LocalController(rec, run_dir)  # type: ignore[arg-type]
    run_dir.write_desired("sql", SPEC, 1)
    ctl.sync_desired()
    rec.adapters["sql"].failure = ("LoadRefused", "bad header")
    ctl.sync_desired()
    assert rec.calls == [("upsert", "sql", 1)]  # nothing new: nothing handed over
    # Deleted and applied again between two polls: same generation, another uid.
    run_dir.delete_desired("sql")
    run_dir.write_desired("sql", SPEC, 1)
    ctl.sync_desired()
    assert rec.calls[1:] == [("forget", "sql", None), ("upsert", "sql", 1)]
    assert rec.adapters["sql"].failure is None
    ctl.write_status()
    assert run_dir.read_status()["sql"]["uid"] == run_dir.read_desired()["sql"]["uid"]
    # Failed, then the same spec again at a new generation (apply's retry): the failure is dropped.
    rec.adapters["sql"].failure = ("LoadRefused", "bad header")
    uid = run_dir.read_desired()["sql"]["uid"]
    run_dir.write_desired("sql", SPEC, 2, uid=uid)
    ctl.sync_desired()
    assert rec.calls[3:] == [("forget", "sql", None), ("upsert", "sql", 2)]
    assert rec.adapters["sql"].failure is None
    await asyncio.sleep(0)

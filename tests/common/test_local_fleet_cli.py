"""`lorafleet adapters` against a run directory, without starting a fleet: the command only needs
the fleet's state file naming a live process, its `desired/` specs and the status it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from lorafleet.local.adapters_cli import age, main
from lorafleet.local.run_dir import FleetState, RunDir

FAILED_STATUS = {
    "phase": "Failed", "readyReplicas": 0, "desiredReplicas": 1, "observedGeneration": 1,
    "conditions": [
        {"type": "Validated", "status": "False", "reason": "LoadRefused", "message": "bad header"},
        {"type": "Ready", "status": "False", "reason": "LoadRefused",
         "message": "adapter_model.safetensors is not a valid\n safetensors file"},
    ],
}
READY_STATUS = {"phase": "Ready", "readyReplicas": 2, "desiredReplicas": 2, "observedGeneration": 1,
                "conditions": [{"type": "Ready", "status": "True", "reason": "Loaded", "message": "2 of 2"}]}


def manifest(name: str, source: str | None = None) -> str:
    return (f"apiVersion: lorafleet.dev/v1alpha1\nkind: LoraAdapter\nmetadata: {{name: {name}}}\n"
            f"spec: {{pool: local, source: {source or name}}}\n")


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    """A fleet whose process is this test's: `sql` Ready, `broken` Failed, `fresh` not yet reconciled."""
    rd = RunDir(tmp_path / ".lorafleet")
    rd.create()
    rd.write_state(FleetState(pid=os.getpid(), router_url="http://127.0.0.1:9", model="tiny", pool="local",
                              device="cpu", store="embedded", adapter_root=str(rd.adapters), workers=()))
    for name in ("sql", "broken", "fresh"):
        (rd.adapters / name).mkdir()
        (rd.adapters / name / "adapter_config.json").write_text("{}")
        rd.write_desired(name, {"pool": "local", "source": name, "replicas": {"min": 1, "max": 2}}, 1,
                         "2026-12-01T10:00:00Z")
    rd.write_status({
        "sql": {"generation": 1, "spec": {"pool": "local"}, "status": READY_STATUS},
        "broken": {"generation": 1, "spec": {"pool": "local"}, "status": FAILED_STATUS},
    })
    return rd


def run(run_dir: RunDir, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(list(args) + ["--run-dir", str(run_dir.root)])  # after the command, as kubectl users write it
    out, err = capsys.readouterr()
    return code, out, err


def test_run_dir_is_accepted_before_and_after_the_command(run_dir: RunDir, capsys: pytest.CaptureFixture) -> None:
    assert main(["--run-dir", str(run_dir.root), "get"]) == 0
    before = capsys.readouterr().out
    code, after, _ = run(run_dir, capsys, "get")
    assert code == 0 and after == before and "sql" in after


def test_get_lists_every_applied_adapter_with_the_crd_columns(run_dir: RunDir, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(run_dir, capsys, "get")
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "POOL", "PHASE", "READY", "REPLICAS", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["sql"][1:5] == ["local", "Ready", "2", "2"]
    assert rows["broken"][2] == "Failed"
    assert rows["fresh"][2] == "Pending"  # applied, not reconciled yet: listed, as the API server would
    assert code == 0


def test_get_wide_shows_the_ready_conditions_reason(run_dir: RunDir, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(run_dir, capsys, "get", "broken", "sql", "-o", "wide")
    header, broken, sql = out.splitlines()
    assert header.split()[6:] == ["SOURCE", "REASON", "MESSAGE"]
    assert broken.split()[0] == "broken"  # in the order asked for
    assert broken.endswith("LoadRefused   adapter_model.safetensors is not a valid safetensors file")
    assert sql.split()[6:] == ["sql", "Loaded", "2", "of", "2"]
    assert code == 0


def test_get_an_unknown_name_is_not_found(run_dir: RunDir, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(run_dir, capsys, "get", "sql", "nope")
    assert code == 1
    assert 'Error from server (NotFound): loraadapters.lorafleet.dev "nope" not found' in err
    assert out.splitlines()[1].startswith("sql")


def test_get_output_json_and_yaml_are_the_objects(run_dir: RunDir, capsys: pytest.CaptureFixture) -> None:
    _, one, _ = run(run_dir, capsys, "get", "broken", "-o", "json")
    obj = json.loads(one)
    assert obj["kind"] == "LoraAdapter" and obj["apiVersion"] == "lorafleet.dev/v1alpha1"
    assert obj["metadata"] == {"name": "broken", "generation": 1, "creationTimestamp": "2026-12-01T10:00:00Z"}
    assert obj["spec"]["source"] == "broken" and obj["status"] == FAILED_STATUS
    _, listed, _ = run(run_dir, capsys, "get", "-o", "yaml")
    doc = yaml.safe_load(listed)
    assert doc["kind"] == "List" and [o["metadata"]["name"] for o in doc["items"]] == ["broken", "fresh", "sql"]
    assert doc["items"][0] == obj
    _, names, _ = run(run_dir, capsys, "get", "-o", "name")
    assert names.split() == [f"loraadapter.lorafleet.dev/{n}" for n in ("broken", "fresh", "sql")]


def test_apply_keeps_the_creation_time_across_updates(run_dir: RunDir, capsys: pytest.CaptureFixture,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "sql.yaml"
    path.write_text(manifest("sql", source="fresh"))
    code, out, _ = run(run_dir, capsys, "apply", "-f", str(path), "--wait", "0")
    assert code == 0 and "loraadapter.lorafleet.dev/sql configured" in out
    entry = run_dir.read_desired()["sql"]
    assert entry["generation"] == 2 and entry["creationTimestamp"] == "2026-12-01T10:00:00Z"
    path.write_text(manifest("new-one", source="sql"))
    assert run(run_dir, capsys, "apply", "-f", str(path), "--wait", "0")[0] == 0
    created = datetime.strptime(run_dir.read_desired()["new-one"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs((datetime.now(timezone.utc).replace(tzinfo=None) - created).total_seconds()) < 60


def test_delete_by_manifest_file(run_dir: RunDir, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(manifest("sql") + "---\n" + manifest("broken") + "---\nkind: LoraPool\nmetadata: {name: p}\n")
    code, out, _ = run(run_dir, capsys, "delete", "-f", str(path))
    assert code == 0
    assert 'loraadapter.lorafleet.dev "sql" deleted' in out and 'loraadapter.lorafleet.dev "broken" deleted' in out
    assert set(run_dir.read_desired()) == {"fresh"}
    with pytest.raises(SystemExit):  # neither names nor -f
        run(run_dir, capsys, "delete")


@pytest.mark.parametrize("seconds, shown", [(0, "0s"), (59, "59s"), (61, "1m"), (7200, "2h"), (3 * 86400 + 5, "3d")])
def test_age_is_kubectls_short_form(seconds: int, shown: str) -> None:
    now = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)
    created = datetime.fromtimestamp(now.timestamp() - seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert age(created, now) == shown
    assert age(None, now) == age("yesterday", now) == "<unknown>"


def test_output_into_a_closed_pipe_is_quiet(run_dir: RunDir) -> None:
    """`lorafleet adapters get -o json | head -1`: the reader leaves early; no traceback, status 141."""
    for i in range(600):  # enough output to outgrow the pipe's buffer
        run_dir.write_desired(f"a{i:04d}", {"pool": "local", "source": "sql", "replicas": {"min": 1, "max": 1}}, 1)
    code = "import sys; from lorafleet.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "adapters", "get", "-o", "json", "--run-dir", str(run_dir.root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(16)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err


def test_a_small_output_into_a_pipe_already_closed_is_quiet(run_dir: RunDir) -> None:
    """Output smaller than stdout's buffer is written at exit unless flushed in `main` (exit 120 and
    "Exception ignored" without PYTHONUNBUFFERED, the usual case)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    code = "import sys; from lorafleet.cli import main; sys.exit(main(sys.argv[1:]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, "adapters", "get", "--run-dir", str(run_dir.root)],
                              stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=60)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr.decode()
    assert b"Exception ignored" not in proc.stderr and b"Traceback" not in proc.stderr


@pytest.mark.parametrize("text", ["kind: LoraAdapter\nmetadata: foo\n", "kind: List\nitems: [1]\n"])
def test_delete_by_a_malformed_manifest_is_an_error_not_a_traceback(run_dir: RunDir, capsys: pytest.CaptureFixture,
                                                                   tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, _, err = run(run_dir, capsys, "delete", "-f", str(path))
    assert code == 1 and err.startswith("error: ")
    assert set(run_dir.read_desired()) == {"sql", "broken", "fresh"}


def test_get_only_unknown_names_prints_only_the_errors(run_dir: RunDir, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(run_dir, capsys, "get", "nope", "-o", "json")
    assert code == 1 and out == "" and "NotFound" in err


def test_apply_reports_an_update_the_workers_refused(run_dir: RunDir, capsys: pytest.CaptureFixture,
                                                     tmp_path: Path) -> None:
    """The old version keeps serving (phase Ready), but the applied spec did not take: an error."""
    refused = {**READY_STATUS, "observedGeneration": 2, "source": "sql", "conditions": [
        {"type": "Ready", "status": "True", "reason": "UpdateRefused", "message": "1/1 replicas loaded from source 'sql'"},
        {"type": "Updated", "status": "False", "reason": "LoadRefused", "message": "no adapter_config.json"},
    ]}
    run_dir.write_status({"sql": {"generation": 2, "spec": {"pool": "local"}, "status": refused}})
    path = tmp_path / "sql.yaml"
    path.write_text(manifest("sql", source="fresh"))
    code, out, err = run(run_dir, capsys, "apply", "-f", str(path), "--wait", "5")
    assert code == 1 and "loraadapter.lorafleet.dev/sql configured" in out
    assert ("error: loraadapter.lorafleet.dev/sql update refused: LoadRefused: no adapter_config.json "
            "(the version from source 'sql' still serves)") in err

"""`lorafleet adapters`: manage the adapters of a running local fleet with LoraAdapter manifests.

    lorafleet adapters apply -f FILE [-f FILE ...]   validate like kubectl, apply, wait until Ready
    lorafleet adapters get                           NAME POOL PHASE READY REPLICAS (like kubectl get)
    lorafleet adapters delete NAME ...               unload everywhere

`apply` writes each validated spec to the run directory with a new generation; the fleet's control
loop (`lorafleet up`, the operator's reconciler) places and loads it and reports the status that
`apply` waits for. Exit status: 0 all applied and Ready, 1 a manifest or an adapter failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from lorafleet.manifests import IGNORED_KINDS, KIND, ManifestError, load_documents, parse_adapter_manifest
from lorafleet.process_group import pid_alive
from lorafleet.run_dir import DEFAULT_RUN_DIR, NotRunning, RunDir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet adapters", description="Manage the adapters of a local fleet.")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="the fleet's run directory (default .lorafleet)")
    sub = p.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", help="apply LoraAdapter manifests (YAML, as for kubectl apply)")
    apply.add_argument("-f", "--filename", action="append", required=True, help="manifest file, folder or - for stdin")
    apply.add_argument("--wait", type=float, default=120.0, help="seconds to wait for Ready (0: do not wait)")
    sub.add_parser("get", help="list adapters and their status")
    delete = sub.add_parser("delete", help="delete adapters (unloaded from every worker)")
    delete.add_argument("names", nargs="+")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    run_dir = RunDir(args.run_dir.resolve())
    try:
        state = run_dir.read_state()
    except NotRunning as exc:
        print(f"lorafleet adapters: {exc}", file=sys.stderr)
        return 1
    if not pid_alive(state.pid):
        print(f"lorafleet adapters: the fleet in {run_dir.root} is not running (pid {state.pid} is gone); "
              "start it with `lorafleet up`", file=sys.stderr)
        return 1
    if args.command == "apply":
        return apply(run_dir, args.filename, args.wait)
    if args.command == "get":
        print(format_table(run_dir.read_status()))
        return 0
    return delete(run_dir, args.names)


def read_sources(filenames: list[str]) -> list[tuple[str, str]]:
    """(label, text) per file; a folder contributes its *.yaml/*.yml/*.json files, sorted."""
    out: list[tuple[str, str]] = []
    for name in filenames:
        if name == "-":
            out.append(("<stdin>", sys.stdin.read()))
            continue
        path = Path(name)
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json")) if path.is_dir() else [path]
        for f in files:
            out.append((str(f), f.read_text()))
    return out


def apply(run_dir: RunDir, filenames: list[str], wait_s: float) -> int:
    try:
        sources = read_sources(filenames)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    failed = False
    applied: dict[str, int] = {}  # name -> generation to wait for
    current = run_dir.read_desired()
    for label, text in sources:
        try:
            docs = load_documents(text, label)
        except ManifestError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed = True
            continue
        for doc in docs:
            kind = doc.get("kind")
            if kind in IGNORED_KINDS:
                print(f"{str(kind).lower()}.lorafleet.dev/{(doc.get('metadata') or {}).get('name')} skipped "
                      "(the local fleet is one pool: its workers)")
                continue
            try:
                manifest = parse_adapter_manifest(doc)
                check_source(run_dir, manifest.spec["source"])
            except ManifestError as exc:
                print(f"error: {label}: {exc}", file=sys.stderr)
                failed = True
                continue
            old = current.get(manifest.name)
            if old is not None and old.get("spec", {}).get("pool") != manifest.spec["pool"]:
                print(f'error: {label}: The {KIND} "{manifest.name}" is invalid: spec.pool: Invalid value: '
                      "spec.pool is immutable; delete and re-create the adapter to move it.", file=sys.stderr)
                failed = True
                continue
            if old is not None and old.get("spec") == manifest.spec:
                verb, generation = "unchanged", int(old.get("generation", 1))
            else:
                verb = "configured" if old is not None else "created"
                generation = int(old.get("generation", 0)) + 1 if old is not None else 1
                run_dir.write_desired(manifest.name, manifest.spec, generation)
                current[manifest.name] = {"spec": manifest.spec, "generation": generation}
            applied[manifest.name] = generation
            print(f"loraadapter.lorafleet.dev/{manifest.name} {verb}")
    if applied and wait_s > 0:
        ready = wait_ready(run_dir, applied, wait_s)
        failed = failed or ready != set(applied)
        if ready:
            failed = not wait_routable(run_dir.read_state().router_url, ready, wait_s) or failed
    return 1 if failed else 0


def check_source(run_dir: RunDir, source: str) -> None:
    """The folder must be on the local adapter volume (on a cluster: the pool's adapter volume)."""
    folder = run_dir.adapters / source
    if not (folder / "adapter_config.json").is_file():
        raise ManifestError(f"spec.source {source!r}: no PEFT adapter at {folder} "
                            f"(copy the folder holding adapter_config.json there)")


def wait_ready(run_dir: RunDir, applied: dict[str, int], wait_s: float) -> set[str]:
    """The applied adapters that became Ready at their generation; prints failures and timeouts."""
    deadline = time.monotonic() + wait_s
    pending = dict(applied)
    ready: set[str] = set()
    while pending:
        statuses = run_dir.read_status()
        for name, generation in list(pending.items()):
            entry = statuses.get(name) or {}
            status = entry.get("status") or {}
            if entry.get("generation") != generation or status.get("observedGeneration") != generation:
                continue
            phase = status.get("phase")
            if phase == "Ready":
                print(f"loraadapter.lorafleet.dev/{name} Ready ({status.get('readyReplicas', 0)}/"
                      f"{status.get('desiredReplicas', 0)} replicas)")
                del pending[name]
                ready.add(name)
            elif phase == "Failed":
                print(f"error: loraadapter.lorafleet.dev/{name} Failed: {failure_message(status)}", file=sys.stderr)
                del pending[name]
        if pending and time.monotonic() > deadline:
            for name in pending:
                phase = ((run_dir.read_status().get(name) or {}).get("status") or {}).get("phase", "Pending")
                print(f"error: loraadapter.lorafleet.dev/{name} not Ready after {wait_s:g}s (phase {phase}); "
                      "see `lorafleet adapters get`", file=sys.stderr)
            return ready
        if pending:
            time.sleep(0.2)
    return ready


def wait_routable(router_url: str, names: set[str], wait_s: float) -> bool:
    """Until the router lists every adapter (it learns placements on its next poll, within a second)."""
    deadline = time.monotonic() + wait_s
    listed: set[str] = set()
    while True:
        try:
            with urllib.request.urlopen(f"{router_url}/v1/models", timeout=2.0) as response:
                listed = {m["id"] for m in json.load(response)["data"]}
        except (OSError, ValueError, KeyError):
            pass
        if names <= listed:
            return True
        if time.monotonic() > deadline:
            print(f"error: the router at {router_url} does not list {', '.join(sorted(names - listed))} "
                  f"after {wait_s:g}s", file=sys.stderr)
            return False
        time.sleep(0.2)


def failure_message(status: dict[str, Any]) -> str:
    for cond in status.get("conditions") or ():
        if cond.get("status") == "False" and cond.get("message"):
            return f"{cond.get('reason')}: {cond.get('message')}"
    return "unknown reason"


def delete(run_dir: RunDir, names: list[str]) -> int:
    missing = False
    for name in names:
        if run_dir.delete_desired(name):
            print(f'loraadapter.lorafleet.dev "{name}" deleted')
        else:
            print(f'Error from server (NotFound): loraadapters.lorafleet.dev "{name}" not found', file=sys.stderr)
            missing = True
    return 1 if missing else 0


def format_table(statuses: dict[str, Any]) -> str:
    rows = [("NAME", "POOL", "PHASE", "READY", "REPLICAS")]
    for name in sorted(statuses):
        entry = statuses[name]
        status = entry.get("status") or {}
        rows.append((name, (entry.get("spec") or {}).get("pool", ""), status.get("phase", "Pending"),
                     str(status.get("readyReplicas", 0)), str(status.get("desiredReplicas", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)

"""`lorafleet adapters`: manage the adapters of a running local fleet with LoraAdapter manifests.

    lorafleet adapters apply -f FILE [-f FILE ...]   validate like kubectl, apply, wait until Ready
    lorafleet adapters get [NAME ...] [-o wide|yaml|json|name]
                                                     NAME POOL PHASE READY REPLICAS AGE, as kubectl
                                                     prints the CRD's columns; `-o wide` adds the
                                                     source and the Ready condition's reason and message
    lorafleet adapters delete NAME ... | -f FILE     unload everywhere
    lorafleet adapters digest SOURCE ...             the content digest a worker reports (for spec.sha256);
                                                     a folder, s3:// or hf:// (no fleet needed)

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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from lorafleet.cli_help import finish
from lorafleet.local.manifests import (
    IGNORED_KINDS,
    KIND,
    ManifestError,
    load_documents,
    parse_adapter_manifest,
)
from lorafleet.local.process_group import pid_alive
from lorafleet.local.run_dir import DEFAULT_RUN_DIR, NotRunning, RunDir
from lorafleet.operator.spec import API_VERSION

RESOURCE = "loraadapter.lorafleet.dev"
OUTPUTS = ("wide", "yaml", "json", "name")


def build_parser() -> argparse.ArgumentParser:
    run_dir_help = "the fleet's run directory (default .lorafleet)"
    p = argparse.ArgumentParser(prog="lorafleet adapters", description="Manage the adapters of a local fleet.")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help=run_dir_help)
    # Also after the command, where kubectl users put their flags (SUPPRESS: absent there, the one
    # before the command stands; given in both places, the later one wins).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run-dir", type=Path, default=argparse.SUPPRESS, help=run_dir_help)
    sub = p.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", parents=[common], help="apply LoraAdapter manifests (YAML, as for kubectl apply)")
    apply.add_argument("-f", "--filename", action="append", required=True, help="manifest file, folder or - for stdin")
    apply.add_argument("--wait", type=float, default=120.0, help="seconds to wait for Ready (0: do not wait)")
    get = sub.add_parser("get", parents=[common], help="list adapters and their status")
    get.add_argument("names", nargs="*", metavar="NAME", help="only these adapters (default: all)")
    get.add_argument("-o", "--output", choices=OUTPUTS, default=None,
                     help="wide: also the source and why an adapter is not Ready; yaml/json: the whole object; "
                          "name: resource/name")
    delete = sub.add_parser("delete", parents=[common], help="delete adapters (unloaded from every worker)")
    delete.add_argument("names", nargs="*", metavar="NAME", help="adapters to delete")
    delete.add_argument("-f", "--filename", action="append", default=[],
                        help="delete the adapters a manifest file or folder names (- for stdin)")
    digest = sub.add_parser("digest", help="print an adapter's content digest, as workers report it (spec.sha256)")
    digest.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="an adapter folder, s3://BUCKET/PREFIX or hf://OWNER/NAME[/SUBFOLDER][@REVISION]")
    digest.add_argument("--max-bytes", type=int, default=2 << 30,
                        help="refuse remote weights larger than this before downloading (a worker's max_adapter_bytes)")
    finish(digest, {"Remote sources (the AWS environment, HF_ENDPOINT, HF_TOKEN)": ["--max-bytes"]})
    finish(apply, {"Manifests": ["--filename", "--wait"], "Fleet": ["--run-dir"]})
    finish(get, {"Output": ["--output"], "Fleet": ["--run-dir"]})
    finish(delete, {"Manifests": ["--filename"], "Fleet": ["--run-dir"]})
    return finish(p, {"Fleet": ["--run-dir"]})


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "delete" and not args.names and not args.filename:
        parser.error("delete: name the adapters, or give -f FILE")
    if args.command == "digest":  # needs no fleet
        from lorafleet.local.digest_cli import main as digest_main

        return digest_main(args.sources, args.max_bytes)
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
        return get(run_dir, args.names, args.output)
    names = list(args.names)
    if args.filename:
        try:
            names += manifest_names(read_sources(args.filename))
        except (OSError, ManifestError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return delete(run_dir, names)


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
    uids: dict[str, str | None] = {}  # name -> the object's uid: an older object's status is not its
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
            retry = old is not None and old.get("spec") == manifest.spec and \
                failed_at(run_dir.read_status(), manifest.name, old)
            if old is not None and old.get("spec") == manifest.spec and not retry:
                verb, generation = "unchanged", int(old.get("generation", 1))
            else:
                # The same spec applied again over a Failed adapter is a retry (its source may have
                # been fixed): a new generation, which the fleet judges afresh.
                verb = "configured (retry: it was Failed)" if retry else "configured" if old is not None else "created"
                generation = int(old.get("generation", 0)) + 1 if old is not None else 1
                created = old.get("creationTimestamp") if old is not None else None
                uid = old.get("uid") if old is not None else None
                current[manifest.name] = run_dir.write_desired(manifest.name, manifest.spec, generation, created, uid)
            applied[manifest.name] = generation
            uids[manifest.name] = current[manifest.name].get("uid")
            print(f"loraadapter.lorafleet.dev/{manifest.name} {verb}")
    if applied and wait_s > 0:
        ready = wait_ready(run_dir, applied, wait_s, uids)
        failed = failed or ready != set(applied)
        if ready:
            failed = not wait_routable(run_dir.read_state().router_url, ready, wait_s) or failed
    return 1 if failed else 0


def check_source(run_dir: RunDir, source: str) -> None:
    """The folder must be on the local adapter volume (on a cluster: the pool's adapter volume); an
    s3:// or hf:// source is the workers' to fetch (its form checked by the CRD's rules)."""
    if "://" in source:
        return
    folder = run_dir.adapters / source
    if not (folder / "adapter_config.json").is_file():
        raise ManifestError(f"spec.source {source!r}: no PEFT adapter at {folder} "
                            f"(copy the folder holding adapter_config.json there)")


def failed_at(statuses: dict[str, Any], name: str, desired: dict[str, Any]) -> bool:
    """The fleet reported this very object Failed at its current generation."""
    entry = statuses.get(name) or {}
    status = entry.get("status") or {}
    return (same_object(entry, desired.get("uid")) and entry.get("generation") == desired.get("generation")
            and status.get("phase") == "Failed")


def same_object(status_entry: dict[str, Any], uid: str | None) -> bool:
    """A status entry is this object's: the same uid (a spec or status without one: by name only)."""
    return uid is None or status_entry.get("uid", uid) == uid


def wait_ready(run_dir: RunDir, applied: dict[str, int], wait_s: float,
               uids: dict[str, str | None] | None = None) -> set[str]:
    """The applied adapters that became Ready at their generation; prints failures and timeouts."""
    deadline = time.monotonic() + wait_s
    pending = dict(applied)
    ready: set[str] = set()
    uids = uids or {}
    while pending:
        statuses = run_dir.read_status()
        for name, generation in list(pending.items()):
            entry = statuses.get(name) or {}
            status = entry.get("status") or {}
            if entry.get("generation") != generation or status.get("observedGeneration") != generation:
                continue
            if not same_object(entry, uids.get(name)):  # a deleted object's status, not yet replaced
                continue
            phase = status.get("phase")
            refused = condition(status, "Updated")
            if refused is not None and refused.get("status") == "False":  # the old version serves; this spec's was refused
                print(f"error: loraadapter.lorafleet.dev/{name} update refused: {refused.get('reason')}: "
                      f"{refused.get('message')} (the version from source {status.get('source')!r} still serves)",
                      file=sys.stderr)
                del pending[name]
            elif phase == "Ready":
                print(f"loraadapter.lorafleet.dev/{name} Ready ({status.get('readyReplicas', 0)}/"
                      f"{status.get('desiredReplicas', 0)} replicas)")
                del pending[name]
                ready.add(name)
            elif phase == "Failed":
                print(f"error: loraadapter.lorafleet.dev/{name} Failed: {failure_message(status)}", file=sys.stderr)
                del pending[name]
        if pending and time.monotonic() > deadline:
            for name in pending:
                entry = run_dir.read_status().get(name) or {}
                status = (entry.get("status") if same_object(entry, uids.get(name)) else None) or {}
                phase = status.get("phase", "Pending")
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
            not_found(name)
            missing = True
    return 1 if missing else 0


def manifest_names(sources: list[tuple[str, str]]) -> list[str]:
    """The LoraAdapter names in manifest files, as `kubectl delete -f` reads them (specs unchecked)."""
    names: list[str] = []
    for label, text in sources:
        for doc in load_documents(text, label):
            if not isinstance(doc, dict):
                raise ManifestError(f"{label}: a document that is not an object: {doc!r:.60}")
            if doc.get("kind") == KIND:
                metadata = doc.get("metadata")
                name = metadata.get("name") if isinstance(metadata, dict) else None
                if not isinstance(name, str) or not name:
                    raise ManifestError(f"{label}: a {KIND} without metadata.name")
                names.append(name)
    return names


def get(run_dir: RunDir, names: list[str], output: str | None) -> int:
    objects = adapter_objects(run_dir.read_desired(), run_dir.read_status())
    missing = [n for n in names if n not in objects]
    for name in missing:
        not_found(name)
    chosen = [objects[n] for n in names if n in objects] if names else [objects[n] for n in sorted(objects)]
    if chosen or (output in ("json", "yaml") and not names):  # kubectl: an empty List, or only the errors
        print(render(chosen, output, single=len(names) == 1, now=datetime.now(timezone.utc)))
    elif not names:
        print("No resources found.", file=sys.stderr)
    return 1 if missing else 0


def adapter_objects(desired: dict[str, Any], statuses: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> the LoraAdapter as the API server would return it: the applied spec (`desired/`, what
    exists) with the status the fleet's reconciler last reported for it (Pending before that)."""
    out: dict[str, dict[str, Any]] = {}
    for name, entry in desired.items():
        metadata: dict[str, Any] = {"name": name, "generation": int(entry.get("generation", 1))}
        if entry.get("creationTimestamp"):
            metadata["creationTimestamp"] = entry["creationTimestamp"]
        reported = statuses.get(name) or {}
        # The status of an object of this name deleted before this one was applied is not this one's.
        status = (reported.get("status") if same_object(reported, entry.get("uid")) else None) or {"phase": "Pending"}
        out[name] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
                     "spec": entry.get("spec") or {}, "status": status}
    return out


def render(objects: list[dict[str, Any]], output: str | None, *, single: bool, now: datetime) -> str:
    if output == "name":
        return "\n".join(f"{RESOURCE}/{o['metadata']['name']}" for o in objects)
    if output in ("json", "yaml"):
        doc: Any = objects[0] if single and objects else {"apiVersion": "v1", "kind": "List", "items": objects}
        if output == "json":
            return json.dumps(doc, indent=4)
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).rstrip("\n")
    return format_table(objects, wide=output == "wide", now=now)


def format_table(objects: list[dict[str, Any]], *, wide: bool = False, now: datetime | None = None) -> str:
    """kubectl's table of the CRD's printer columns (NAME POOL PHASE READY REPLICAS AGE); wide adds
    SOURCE and the Ready condition's reason and message."""
    header = ["NAME", "POOL", "PHASE", "READY", "REPLICAS", "AGE"] + (["SOURCE", "REASON", "MESSAGE"] if wide else [])
    rows = [header]
    for obj in objects:
        spec, status = obj["spec"], obj["status"]
        row = [obj["metadata"]["name"], str(spec.get("pool", "")), str(status.get("phase", "Pending")),
               str(status.get("readyReplicas", 0)), str(status.get("desiredReplicas", 0)),
               age(obj["metadata"].get("creationTimestamp"), now or datetime.now(timezone.utc))]
        if wide:
            reason, message = ready_condition(status)
            row += [str(spec.get("source", "")), reason, message]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The status's condition of type `kind`, if it has one."""
    return next((c for c in status.get("conditions") or () if c.get("type") == kind), None)


def ready_condition(status: dict[str, Any]) -> tuple[str, str]:
    """(reason, message) of the Ready condition (the CRD's Reason and Message columns)."""
    ready = condition(status, "Ready") or {}
    return str(ready.get("reason") or ""), " ".join(str(ready.get("message") or "").split())


def not_found(name: str) -> None:
    print(f'Error from server (NotFound): loraadapters.lorafleet.dev "{name}" not found', file=sys.stderr)


def age(timestamp: str | None, now: datetime) -> str:
    """kubectl's short age: 42s, 5m, 3h, 2d (<unknown> without a timestamp)."""
    if not timestamp:
        return "<unknown>"
    try:
        created = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return "<unknown>"
    seconds = max(0, int((now - created).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"

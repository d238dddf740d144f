"""The operator SIGKILLed mid-reconcile converges after a restart: no orphaned loads, no stuck finalizer.

Unlike test_e2e's in-process kill (a task cancellation, which still runs `finally` blocks and
context managers), the operator here is the real `python -m lorafleet operator` process, killed
with SIGKILL: nothing of it gets to clean up. It talks to the emulator over loopback HTTP through a
kubeconfig, as kubectl does; the test kubelet runs fake workers in this process, so every load and
unload the operator makes is visible in their inventories and call logs.

The kills are made to land mid-reconcile: with 30 adapters Ready, one burst (written in-process, so
the operator sees it all at once) deletes 8 of them, rescales 6 and creates 16 more. The operator
takes the deletions first, then the loads; a process is killed as soon as the first unload of a
deleted adapter (A) or the first load of a new one (B) reaches a worker, and the test checks that the
work was indeed left half done: deleted objects still held by their finalizer and still loaded
elsewhere (A), new adapters loaded but not Ready (B). After the last restart: every adapter Ready on
exactly its k pods per the workers' own inventories, the deleted ones unloaded everywhere and gone
(finalizer released), nothing loaded that no LoraAdapter asks for, status aggregates that agree.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from lorafleet.local import process_group
from lorafleet.operator.spec import GROUP
from tests.operator.conftest import Kubectl, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import LA, adapter_manifest, apply, pool_manifest

FINALIZER = f"{GROUP}/finalizer"
PODS = 3


class OperatorProcess:
    """`python -m lorafleet operator` in its own process group, pointed at the emulator by kubeconfig."""

    def __init__(self, kubeconfig: Path, workdir: Path) -> None:
        self.kubeconfig, self.workdir = kubeconfig, workdir
        self.started: list[process_group.Child] = []

    def start(self) -> process_group.Child:
        argv = [sys.executable, "-m", "lorafleet", "operator", "--namespace", "default",
                "--resync", "1", "--worker-timeout", "3"]
        env = {k: v for k, v in os.environ.items() if k not in ("LORAFLEET_REDIS_URL", "KUBERNETES_SERVICE_HOST")}
        # Safe path and a cwd outside the repository: `./operator` must not shadow the stdlib's module.
        env.update(KUBECONFIG=str(self.kubeconfig), PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")
        name = f"operator-{len(self.started)}"
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            # Its own session, so the kill takes its whole group; PDEATHSIG, so a killed pytest takes it too.
            process = subprocess.Popen(argv, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=process_group._die_with_parent)
        child = process_group.Child(name, process, log_path)
        self.started.append(child)
        return child

    @staticmethod
    def sigkill(child: process_group.Child) -> int | None:
        """SIGKILL the whole group and reap it; the exit status (-9 if it was still running)."""
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return child.process.wait(timeout=5)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} (pid {c.pid}):\n{c.log_tail(40)}" for c in self.started)


@pytest.fixture
async def operator_process(kubeconfig_path: Path, tmp_path: Path) -> AsyncIterator[OperatorProcess]:
    workdir = tmp_path / "operator"
    workdir.mkdir()
    procs = OperatorProcess(kubeconfig_path, workdir)
    try:
        yield procs
    finally:
        for child in procs.started:
            procs.sigkill(child)


def loads(kubelet: Kubelet) -> dict[str, list[str]]:
    """adapter -> the pods whose worker has it loaded (the workers' own inventories)."""
    out: dict[str, list[str]] = {}
    for pod in kubelet.pods.values():
        for name in pod.worker.state.adapters:
            out.setdefault(name, []).append(pod.name)
    return out


Mark = dict[str, int]  # pod -> how many calls its worker had received


def mark(kubelet: Kubelet) -> Mark:
    return {name: len(pod.worker.state.calls) for name, pod in kubelet.pods.items()}


def calls_since(kubelet: Kubelet, since: Mark) -> list[tuple[str, str]]:
    """(op, adapter) of every load/unload the workers received after `since`."""
    return [c for name, pod in kubelet.pods.items() for c in pod.worker.state.calls[since.get(name, 0):]]


def converged(api: PatchedEmulator, kubelet: Kubelet, wanted: dict[str, int]) -> bool:
    """Every wanted adapter loaded on exactly its k pods and Ready; nothing else loaded anywhere."""
    placed = loads(kubelet)
    if set(placed) != set(wanted) or any(len(placed[n]) != k for n, k in wanted.items()):
        return False
    return all((api.get(LA, "default", n) or {}).get("status", {}).get("phase") == "Ready" for n in wanted)


async def kill_at(kubelet: Kubelet, child: process_group.Child, since: Mark, op: str, names: Iterable[str],
                  timeout: float = 10.0) -> None:
    """SIGKILL `child` (and reap it) as soon as a worker receives an `op` of one of `names` after `since`."""
    names = set(names)
    deadline = time.monotonic() + timeout
    while not any(o == op and n in names for o, n in calls_since(kubelet, since)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the operator made no {op} of {sorted(names)}")
        await asyncio.sleep(0.001)
    assert OperatorProcess.sigkill(child) == -signal.SIGKILL  # it was running, and died by SIGKILL
    await asyncio.sleep(0.2)  # what reached the emulator or a worker before the kill lands


OLD = {f"old{i}": i % 3 + 1 for i in range(30)}  # name -> k replicas (1..3 of the 3 pods)
NEW = {f"new{i}": i % 3 + 1 for i in range(16)}
DELETED = [f"old{i}" for i in (0, 4, 8, 9, 13, 14, 18, 20)]  # k = 1, 2 and 3
RESCALED = {"old2": 1, "old5": 1, "old11": 2, "old24": 3, "old25": 3, "old27": 2}  # new k: 3->1, 1->3, ...
WANTED = {**{n: k for n, k in OLD.items() if n not in DELETED}, **RESCALED, **NEW}


def phase(api: PatchedEmulator, name: str) -> str | None:
    return ((api.get(LA, "default", name) or {}).get("status") or {}).get("phase")


async def ready_then_burst(api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet,
                           operator: process_group.Child, root: Path) -> Mark:
    """OLD applied with kubectl and Ready; then the burst. Returns the mark taken just before it."""
    for name in (*OLD, *NEW):
        write_adapter(root, name)
    await apply(kubectl, root, pool_manifest(root, replicas=PODS, max_cpu_loras=64),
                *(adapter_manifest(n, k, k) for n, k in OLD.items()))
    await eventually(lambda: converged(api, kubelet, OLD), timeout=20)
    assert operator.alive()
    # Written without yielding to the event loop: the operator sees the whole burst at once.
    since = mark(kubelet)
    for name in DELETED:
        await api.delete_object(LA, "default", name)  # the finalizer holds it: deletionTimestamp only
    for name, k in RESCALED.items():
        await api.patch_object(LA, "default", name, {"spec": {"replicas": {"min": k, "max": k}}})
    for name, k in NEW.items():
        await api.put_object(LA, {**adapter_manifest(name, k, k), "metadata": {"name": name, "namespace": "default"}})
    return since


async def kill_mid_unloads(api: PatchedEmulator, kubelet: Kubelet, operator: process_group.Child, since: Mark) -> None:
    """Kill A: deleted adapters held by their finalizer, some of them still loaded somewhere."""
    await kill_at(kubelet, operator, since, "unload", DELETED)
    placed = loads(kubelet)
    held = [n for n in DELETED if api.get(LA, "default", n) is not None]
    assert [n for n in held if n in placed], (held, placed)
    for name in held:
        assert FINALIZER in api.get(LA, "default", name)["metadata"]["finalizers"]


async def assert_converges(api: PatchedEmulator, kubelet: Kubelet, operator: process_group.Child) -> None:
    try:
        # No stuck finalizer: every deleted adapter is unloaded and then really gone.
        await eventually(lambda: all(api.get(LA, "default", n) is None for n in DELETED), timeout=10)
        # Every adapter Ready on exactly its k pods, and nothing loaded that no LoraAdapter asks for.
        await eventually(lambda: converged(api, kubelet, WANTED), timeout=10)
    except AssertionError:
        placed = loads(kubelet)
        for name in sorted(set(placed) | set(WANTED) | set(DELETED)):
            if len(placed.get(name, [])) != WANTED.get(name, 0) or phase(api, name) != ("Ready" if name in WANTED else None):
                print(f"not converged: {name} wants k={WANTED.get(name, 0)}, loaded on {placed.get(name, [])}, "
                      f"phase {phase(api, name)}")
        raise
    assert operator.alive()

    # Status aggregates agree with the workers' inventories and the current spec.
    placed = loads(kubelet)
    for name, k in WANTED.items():
        obj = api.get(LA, "default", name)
        st = obj["status"]
        assert (st["readyReplicas"], st["desiredReplicas"], len(placed[name])) == (k, k, k), (name, st)
        assert st["observedGeneration"] == obj["metadata"]["generation"], (name, st)
        conditions = {c["type"]: c["status"] for c in st["conditions"]}
        assert conditions == {"Validated": "True", "Placed": "True", "Ready": "True"}, (name, st)
        assert FINALIZER in obj["metadata"]["finalizers"]
    assert not kubelet.errors


async def test_sigkilled_mid_unloads_then_mid_loads_converges(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator_process: OperatorProcess, tmp_path: Path
) -> None:
    first = operator_process.start()
    try:
        since = await ready_then_burst(api, kubectl, kubelet, first, tmp_path)
        await kill_mid_unloads(api, kubelet, first, since)

        second = operator_process.start()
        since = mark(kubelet)
        await kill_at(kubelet, second, since, "load", NEW)  # kill B
        placed = loads(kubelet)
        assert [n for n in NEW if n in placed] and [n for n in NEW if phase(api, n) != "Ready"]

        await assert_converges(api, kubelet, operator_process.start())
    except BaseException:
        print(operator_process.logs())
        raise


async def test_sigkilled_mid_unloads_converges(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator_process: OperatorProcess, tmp_path: Path
) -> None:
    first = operator_process.start()
    try:
        since = await ready_then_burst(api, kubectl, kubelet, first, tmp_path)
        await kill_mid_unloads(api, kubelet, first, since)
        await assert_converges(api, kubelet, operator_process.start())
    except BaseException:
        print(operator_process.logs())
        raise

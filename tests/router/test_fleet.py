"""Fleet state: views, overlay after polls, ejection and re-admission."""

from __future__ import annotations

from lorafleet.protocol import AdapterInfo, AdapterInventory
from lorafleet.router.discovery import Endpoint
from lorafleet.router.fleet import Fleet, Replica


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def inventory(**tiers: str) -> AdapterInventory:
    return AdapterInventory(
        model="base",
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=16,
        max_loras_per_request=2,
        num_requests_running=3,
        adapters=[
            AdapterInfo(
                name=n,
                tier=t,
                rank=8,
                alpha=16,
                digest="sha256:0",
                path=f"/a/{n}",
                requests_in_flight=int(t == "gpu"),
            )
            for n, t in tiers.items()
        ],
    )


def test_view_merges_poll_overlay_and_store():
    r = Replica("r0", "http://r0")
    r.apply_poll(inventory(a="gpu", b="cpu", c="disk"), started_at=10.0)
    r.set_shared({"s": "cpu"})
    r.note("n", "cpu", 11.0)
    r.note("b", None, 11.0)
    v = r.view(now=12.0, capacity=64)
    assert v.gpu == {"a"} and v.cpu == {"a", "n", "s"} and v.active == {"a"} and v.running == 3 and v.healthy
    r.apply_poll(inventory(a="gpu"), started_at=12.0)  # a newer poll is the truth: overlay dropped
    assert r.view(now=13.0, capacity=64).cpu == {"a", "s"}


def test_unpolled_replica_is_unhealthy():
    assert not Replica("r0", "http://r0").view(0.0, 64).healthy


def test_ejection_and_readmission():
    clock = Clock()
    fleet = Fleet(eject_after=3, cooldown_s=5.0, clock=clock)
    fleet.set_endpoints([ep("r0"), ep("r1")])
    assert [fleet.record_failure("r0", unreachable=False) for _ in range(3)] == [False, False, True]
    assert [v.name for v in fleet.views() if v.ejected] == ["r0"]
    assert fleet.due_for_probe() == []
    clock.now += 5.0
    assert [r.name for r in fleet.due_for_probe()] == ["r0"]
    fleet.readmit("r0")
    assert not any(v.ejected for v in fleet.views())
    fleet.record_failure("r1", unreachable=True)
    assert not fleet.replicas["r1"].reachable
    fleet.record_success("r1")
    assert fleet.replicas["r1"].failures == 0


def ep(name: str, admin: str | None = None, pool: str | None = None) -> Endpoint:
    return Endpoint(name, f"http://{name}", admin or f"http://{name}", pool)


def test_set_endpoints_keeps_state_of_stayers():
    fleet = Fleet()
    fleet.set_endpoints([ep("r0"), ep("r1")])
    fleet.replicas["r0"].inflight = 5
    fleet.set_endpoints([ep("r0"), ep("r2")])
    assert set(fleet.replicas) == {"r0", "r2"} and fleet.replicas["r0"].inflight == 5


def test_set_endpoints_carries_admin_url_and_pool_and_replaces_a_moved_replica():
    fleet = Fleet()
    fleet.set_endpoints([ep("r0", admin="http://r0:8001", pool="p")])
    r0 = fleet.replicas["r0"]
    assert (r0.url, r0.admin_url, r0.pool) == ("http://r0", "http://r0:8001", "p")
    r0.inflight = 5
    fleet.set_endpoints([ep("r0", admin="http://r0:9001", pool="p")])  # same name, new admin port
    assert fleet.replicas["r0"].admin_url == "http://r0:9001" and fleet.replicas["r0"].inflight == 0


def test_replica_admin_url_defaults_to_public_url():
    assert Replica("r0", "http://r0").admin_url == "http://r0"


def test_slow_polls_keep_a_replica_in_rotation_until_three_in_a_row():
    """A poll that times out (a worker busy on 2 CPU cores, say) keeps the replica on its last
    inventory; three in a row take it out; a refused or malformed poll does at once."""
    from lorafleet.router.fleet import POLL_TIMEOUTS_UNREACHABLE

    r = Replica(name="r0", url="http://r0")
    r.apply_poll(inventory(a="gpu"), started_at=1.0)
    for _ in range(POLL_TIMEOUTS_UNREACHABLE - 1):
        r.poll_failed(timed_out=True)
        assert r.reachable and r.view(2.0, 4).healthy
    r.poll_failed(timed_out=True)
    assert not r.reachable and not r.view(2.0, 4).healthy
    r.apply_poll(inventory(a="gpu"), started_at=3.0)  # answers again: back, and the count starts over
    assert r.reachable and r.poll_timeouts == 0
    r.poll_failed(timed_out=True)
    r.poll_failed(timed_out=False)  # refused: out at once, and the timeouts' count resets
    assert not r.reachable and r.poll_timeouts == 0

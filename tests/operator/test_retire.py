"""operator/retire.py: which pods go, when a gate opens, deletion costs (pure, against hand-built states)."""

from __future__ import annotations

from lorafleet.operator import placement, retire
from lorafleet.operator.pool_state import PodState
from lorafleet.operator.reconciler import PoolReconciler


def pod(name: str, revision: str = "r1", *, serving: bool = True, gated: bool = True, gate_open: bool = True,
        draining: bool = False, cost: int | None = None, created: str = "2026-01-01T00:00:00Z") -> PodState:
    return PodState(name, f"10.0.0.{len(name)}", ready=True, draining=draining, serving=serving, gated=gated,
                    gate_open=gate_open, revision=revision, cost=cost, created=created)


def pods_of(*pods: PodState) -> dict[str, PodState]:
    return {p.name: p for p in pods}


def assignment(pods: dict[str, tuple[str, ...]]) -> placement.Assignment:
    return placement.Assignment(pods=dict(pods), wanted={n: max(len(w), 1) for n, w in pods.items()})


def test_no_surplus_no_retiring() -> None:
    pods = pods_of(pod("a"), pod("b"))
    assert retire.retiring(pods, 2, {"a": {"x"}, "b": {"y"}}, {"x", "y"}) == set()


def test_scale_down_retires_the_pod_whose_copies_exist_elsewhere() -> None:
    pods = pods_of(pod("a"), pod("b"), pod("c"))
    loaded = {"a": {"x", "shared"}, "b": {"y", "shared"}, "c": {"shared"}}
    assert retire.retiring(pods, 2, loaded, {"x", "y", "shared"}) == {"c"}
    assert retire.retiring(pods, 1, loaded, {"x", "y", "shared"}) == {"a", "c"}  # by sole copies, then name


def test_rollout_retires_only_pods_of_an_older_template() -> None:
    # b holds nothing alone, but it is of the new template: the Deployment removes old pods only.
    pods = pods_of(pod("a", "old"), pod("c", "old"), pod("b", "new"),
                   pod("n", "new", serving=False, gate_open=False, created="2026-01-02T00:00:00Z"))
    loaded = {"a": {"x"}, "c": {"y", "z"}, "b": {"x"}, "n": set()}
    assert retire.retiring(pods, 3, loaded, {"x", "y", "z"}) == {"a"}


def test_a_pod_marked_retiring_stays_so_after_a_takeover() -> None:
    pods = pods_of(pod("a", "old"), pod("c", "old", cost=retire.RETIRING_COST),
                   pod("n", "new", serving=False, gate_open=False))
    loaded = {"a": set(), "c": {"y", "z"}, "n": set()}
    assert retire.retiring(pods, 2, loaded, {"y", "z"}) == {"c"}


def test_terminating_pods_are_no_surplus() -> None:
    pods = pods_of(pod("a", "old", draining=True), pod("b", "new"), pod("c", "new"))
    assert retire.retiring(pods, 2, {"b": set(), "c": set()}, set()) == set()


def test_gate_waits_for_the_share_then_for_the_leaving_pods_sole_copies() -> None:
    pods = pods_of(pod("old1", "old"), pod("old2", "old"), pod("new", "new", serving=False, gate_open=False))
    target = assignment({"x": ("new",), "y": ("old2",)})  # y: old1's, placed on old2
    leaving = {"old1"}
    # The new pod lacks its share.
    assert retire.gates_to_open(pods, {"old1": {"x", "y"}, "old2": set(), "new": set()}, target, leaving) == set()
    # It has it, but y's only copy is on the leaving pod: opening would let the Deployment remove it.
    assert retire.gates_to_open(pods, {"old1": {"x", "y"}, "old2": set(), "new": {"x"}}, target, leaving) == set()
    # y serves on old2 too: the gate opens (x's copy on the opening pod counts).
    assert retire.gates_to_open(pods, {"old1": {"x", "y"}, "old2": {"y"}, "new": {"x"}}, target, leaving) == {"new"}


def test_a_leaving_pod_not_polled_holds_the_gate() -> None:
    pods = pods_of(pod("old1", "old"), pod("new", "new", serving=False, gate_open=False))
    assert retire.gates_to_open(pods, {"new": set()}, assignment({}), {"old1"}) == set()


def test_an_adapter_with_no_room_elsewhere_does_not_block_for_ever() -> None:
    pods = pods_of(pod("a"), pod("b"))
    target = placement.Assignment(pods={"x": ()}, wanted={"x": 1})  # wanted, but no room on b
    assert retire.evacuated({"a"}, pods, {"a": {"x"}, "b": set()}, target)
    target = placement.Assignment(pods={"x": ("b",)}, wanted={"x": 1})  # room on b: wait for the load
    assert not retire.evacuated({"a"}, pods, {"a": {"x"}, "b": set()}, target)


def test_a_pod_that_does_not_serve_is_no_other_copy() -> None:
    pods = pods_of(pod("a"), pod("b", serving=False, gate_open=False))
    target = placement.Assignment(pods={"x": ("b",)}, wanted={"x": 1})
    assert not retire.evacuated({"a"}, pods, {"a": {"x"}, "b": {"x"}}, target)
    assert retire.evacuated({"a"}, pods, {"a": {"x"}, "b": {"x"}}, target, opening={"b"})


def test_deletion_costs() -> None:
    pods = pods_of(pod("a"), pod("b"), pod("c"), pod("n", serving=False, gate_open=False))
    loaded = {"a": {"x", "y", "s"}, "b": {"s", "z"}, "c": {"s"}, "n": {"x"}}
    assert retire.deletion_costs(pods, loaded, {"x", "y", "z", "s"}, set()) == {"a": 2, "b": 1, "c": 0}
    # c leaves: s's copies on a and b are no longer counted against it; c goes first.
    assert retire.deletion_costs(pods, loaded, {"x", "y", "z", "s"}, {"c"}) == {"a": 2, "b": 1, "c": -1}
    assert retire.deletion_costs(pods, {"a": {"s"}, "b": {"s"}}, {"s"}, {"a"}) == {"a": -1, "b": 1}


def test_a_pod_retiring_no_more_loses_its_lowest_cost_even_unpolled() -> None:
    pods = pods_of(pod("a", cost=retire.RETIRING_COST), pod("b"))
    assert retire.deletion_costs(pods, {"b": {"x"}}, {"x"}, set()) == {"a": 0, "b": 1}


def test_what_a_term_wrote_outlives_a_late_event_but_not_the_pod() -> None:
    """A pod event sent before the operator's write may arrive after it: the write wins. A pod
    re-created under its name (another uid, a StatefulSet's) starts with nothing written."""
    reconciler = PoolReconciler("default", "pool", workers=None, kube=None, store=None)  # type: ignore[arg-type]
    reconciler.pods["a"] = PodState("a", "10.0.0.1", True, False, serving=True, gated=True, uid="u1")
    reconciler._mark("a", cost=retire.RETIRING_COST, gate_open=True)
    reconciler.pods["a"] = PodState("a", "10.0.0.1", True, False, serving=True, gated=True, cost=3, uid="u1")
    assert (reconciler._marked()["a"].cost, reconciler._marked()["a"].gate_open) == (retire.RETIRING_COST, True)
    reconciler.pods["a"] = PodState("a", "10.0.0.2", True, False, serving=False, gated=True, uid="u2")
    assert (reconciler._marked()["a"].cost, reconciler._marked()["a"].gate_open) == (None, False)
    assert reconciler._marks == {}

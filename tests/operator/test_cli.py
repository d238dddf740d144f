"""`lorafleet operator`'s flags: what reaches `kopf.operator`, and the liveness endpoint the chart's
livenessProbe calls (kopf's, run against the emulator)."""

from __future__ import annotations

import httpx

from lorafleet.local.process_group import free_port
from lorafleet.operator.cli import build_parser, operator_kwargs
from tests.operator.conftest import OperatorRunner, eventually
from tests.operator.kmock_harness import PatchedEmulator


def test_flags_reach_kopf() -> None:
    kwargs = operator_kwargs(build_parser().parse_args(["-n", "team-a", "--liveness", "http://0.0.0.0:8080/healthz"]))
    assert kwargs["namespaces"] == ["team-a"] and not kwargs["clusterwide"] and kwargs["standalone"]
    assert kwargs["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert operator_kwargs(build_parser().parse_args(["-A"]))["liveness_endpoint"] is None
    peered = operator_kwargs(build_parser().parse_args(["-A", "--peering", "lf"]))
    assert peered["clusterwide"] and not peered["standalone"] and peered["priority"] > 0


async def test_the_liveness_endpoint_answers(api: PatchedEmulator) -> None:
    url = f"http://127.0.0.1:{free_port()}/healthz"
    runner = OperatorRunner(api, liveness=url)
    await runner.start()
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            async def ok() -> bool:
                try:
                    return (await http.get(url)).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(ok, timeout=10)
    finally:
        await runner.kill()

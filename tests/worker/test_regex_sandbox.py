"""Adapter regexes matched in the helper process: PEFT's semantics, budgets, and a catastrophic
pattern refused with a 4xx while another tenant's decode keeps streaming on a real server."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time

import httpx
import pytest

from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.regex_sandbox import FULL, SUFFIX, RegexSandbox
from tests.worker.worker_harness import TOKEN, RunningWorker, auth, worker_settings

NAMES = [f"model.layers.{i}.{m}" for i in range(3) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")]
# Backtracking that doubles with each character of a name (no match is possible): 0.2 s on 20
# characters, minutes on "model.layers.10.self_attn.q_proj", in-process.
CATASTROPHIC = r"([a-z_.0-9]+)+[A-Z]"


@pytest.fixture(scope="module")
def sandbox():
    s = RegexSandbox()
    yield s
    s.close()


@pytest.mark.parametrize("pattern", [r".*q_proj", r"model\.layers\.[02]\..*", r"(?i).*UP_PROJ", "v_proj", ".*"])
def test_full_match_is_peft_fullmatch(sandbox, pattern):
    (got,) = sandbox.match(NAMES, [(FULL, pattern)], "target_modules")
    assert got.hits == [i for i, n in enumerate(NAMES) if re.fullmatch(pattern, n)]


@pytest.mark.parametrize("key", ["q_proj", r"layers\.1\.self_attn\.v_proj", "proj", "mlp.up_proj", r"\d\.mlp\.up_proj"])
def test_suffix_match_is_peft_get_pattern_key(sandbox, key):
    from peft.utils.other import get_pattern_key

    (got,) = sandbox.match(NAMES, [(SUFFIX, key)], "rank_pattern")
    assert got.hits == [i for i, n in enumerate(NAMES) if get_pattern_key([key], n) == key]


def test_a_pattern_that_does_not_compile_is_reported(sandbox):
    (got,) = sandbox.match(NAMES, [(FULL, "(q_proj")], "target_modules")
    assert got.hits is None and "missing )" in got.error


def test_catastrophic_backtracking_is_refused_and_the_helper_restarts(sandbox):
    with pytest.raises(AdapterError) as info:
        sandbox.match(NAMES * 10, [(FULL, CATASTROPHIC)], "target_modules")
    assert info.value.reason == "regex_budget" and "CPU" in str(info.value)
    (got,) = sandbox.match(NAMES, [(FULL, ".*q_proj")], "target_modules")  # a fresh helper answers
    assert len(got.hits) == 3


def test_a_helper_out_of_memory_is_a_refusal_not_a_hang():
    small = RegexSandbox(memory_bytes=64 << 20)
    try:
        with pytest.raises(AdapterError) as info:  # 2.7M names: their list is over 64 MiB in the helper
            small.match(NAMES * 300_000, [(FULL, ".*")], "target_modules")
        assert info.value.reason == "regex_budget"
    finally:
        small.close()


def test_oversized_pattern_lists_are_refused_before_matching(sandbox):
    with pytest.raises(AdapterError, match="characters"):
        sandbox.match(NAMES, [(FULL, "a" * 5000)], "target_modules")
    with pytest.raises(AdapterError, match="patterns"):
        sandbox.match(NAMES, [(SUFFIX, f"k{i}") for i in range(2000)], "rank_pattern")


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_model, demo_adapters):
    base = tmp_path_factory.mktemp("regex")
    root = base / "root"
    root.mkdir()
    evil = root / "evil"
    shutil.copytree(demo_adapters["sql"], evil)
    cfg = json.loads((evil / "adapter_config.json").read_text())
    cfg["target_modules"] = CATASTROPHIC
    (evil / "adapter_config.json").write_text(json.dumps(cfg))
    token = base / "token"
    token.write_text(TOKEN + "\n")
    w = RunningWorker(worker_settings(demo_model, {"sql": demo_adapters["sql"]}, token_file=token,
                                      adapter_root=root)).start()
    yield w
    w.stop()


def test_catastrophic_regex_load_is_refused_while_a_decode_streams(served):
    """The load is a 400 naming the budget, and the other tenant's tokens keep arriving during it
    (in-process, the same match froze the whole worker for as long as it ran)."""
    arrivals: list[float] = []
    started = threading.Event()

    def decode() -> None:
        body = {"model": "sql", "prompt": "SELECT name FROM", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    started.set()

    reader = threading.Thread(target=decode)
    reader.start()
    assert started.wait(60)
    t0 = time.monotonic()
    r = httpx.post(f"{served.admin_url}/v1/load_lora_adapter", headers=auth(), timeout=60,
                   json={"lora_name": "evil", "lora_path": "evil"})
    t1 = time.monotonic()
    reader.join(120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["reason"] == "regex_budget"
    assert "target_modules" in r.json()["error"]["message"]
    during = [t for t in arrivals if t0 < t < t1]
    assert arrivals[-1] > t1, "the decode should outlast the load (raise max_tokens)"
    assert len(during) >= 3, f"tokens arrived {len(during)} times during a {t1 - t0:.2f} s load"
    gaps = [b - a for a, b in zip([t0, *during], [*during, t1])]
    assert max(gaps) < (t1 - t0) / 2, "the decode stalled for most of the load"

"""vLLM's own parser on the flag-parity table: every pinned parse in tests/worker/vllm_flag_cases.py
(which tests/worker/test_vllm_flag_parity.py holds our parser to) is what vLLM 0.32's
`make_arg_parser(FlexibleArgumentParser())` gives, run as a subprocess in vLLM's virtualenv; the
pinned list of vLLM's flags is its parser's; the defaults vLLM resolves per device
(tests/worker/vllm_device_cases.py, which the worker's resolution is held to) are what vLLM's own code
resolves with its platform given each device's figures; and `--api-key` guards and leaves open the
same paths on both servers."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from lorafleet.worker.server.vllm_flag_names import VLLM_FLAGS
from tests.vllm.vllm_server import API_KEY, skip_reason, vllm_python
from tests.worker.vllm_device_cases import DEVICE_CASES
from tests.worker.vllm_flag_cases import CASES, MODEL, SETTINGS, vllm_parse

pytestmark = [pytest.mark.timeout(600), pytest.mark.vllm,
              pytest.mark.skipif(vllm_python() is None, reason=skip_reason())]

SCRIPT = Path(__file__).with_name("vllm_parse.py")
DEFAULTS_SCRIPT = Path(__file__).with_name("vllm_defaults.py")


@pytest.fixture(scope="module")
def vllm_parsed(request, tmp_path_factory) -> dict:
    argvs = [[*MODEL, *c.argv] for c in CASES]
    proc = subprocess.Popen([vllm_python(), str(SCRIPT), json.dumps(SETTINGS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path_factory.mktemp("vllm-parse"))  # not the repo: its operator/ shadows
    # The tier's one vLLM server starts meanwhile (its tests need it anyway): the two imports of
    # vLLM overlap instead of adding up.
    request.getfixturevalue("vllm_server")
    out, err = proc.communicate(json.dumps(argvs), timeout=400)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_pinned_flag_list_is_vllms(vllm_parsed):
    assert set(vllm_parsed["flags"]) == VLLM_FLAGS


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_the_pinned_parse_is_vllms(vllm_parsed, index):
    case, got = CASES[index], vllm_parsed["cases"][index]
    want = vllm_parse(case)
    if "error" in want:
        assert "error" in got and want["error"] in got["error"], got
    else:
        assert got == want


@pytest.fixture(scope="module")
def vllm_device_defaults(tmp_path_factory) -> dict:
    proc = subprocess.run([vllm_python(), str(DEFAULTS_SCRIPT)], input=json.dumps([c.for_vllm() for c in DEVICE_CASES]),
                          capture_output=True, text=True, timeout=400, cwd=tmp_path_factory.mktemp("vllm-defaults"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(DEVICE_CASES)), ids=[c.id for c in DEVICE_CASES])
def test_the_pinned_device_defaults_are_vllms(vllm_device_defaults, index):
    case, got = DEVICE_CASES[index], vllm_device_defaults["devices"][index]
    block = vllm_device_defaults["cpu_block_size" if case.kind == "cpu" else "cuda_block_size"]
    assert (got["max_num_seqs"], got["max_num_batched_tokens"], block) == (
        case.max_num_seqs, case.max_num_batched_tokens, case.block_size)
    assert got["dtypes"] == case.dtypes


PATHS = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics"),
         ("POST", "/tokenize"), ("OPTIONS", "/v1/models")]


@pytest.fixture(scope="module")
def our_guarded(vllm_assets, served_name):
    from lorafleet.worker.config import EngineConfig
    from lorafleet.worker.server.settings import WorkerSettings
    from tests.worker.worker_harness import RunningWorker

    settings = WorkerSettings(model=str(vllm_assets / "model"), served_model_name=served_name,
                              engine=EngineConfig(num_kv_blocks=64, dtype="float32"), freeze_gc=False)
    w = RunningWorker(replace(settings, api_keys=(API_KEY,))).start()
    yield w
    w.stop()


def guarded(url: str, method: str, path: str, served_name: str, key: str | None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": served_name, "prompt": "hi", "max_tokens": 1} if method == "POST" else None
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60).status_code == 401


def test_api_key_guards_the_same_paths_as_vllms(vllm_server, our_guarded, served_name):
    for method, path in PATHS:
        for key in (None, "wrong", API_KEY):
            theirs = guarded(vllm_server.url, method, path, served_name, key)
            ours = guarded(our_guarded.url, method, path, served_name, key)
            assert ours == theirs, (method, path, key, ours, theirs)
    assert guarded(our_guarded.url, "GET", "/v1/models", served_name, None)  # the comparison saw a guard

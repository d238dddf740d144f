"""test_responses_api again on CUDA: the served worker with CUDA graphs, async scheduling and the
Triton kernels behind `POST /v1/responses`, its answers compared with chat's for the same greedy
request through the official `openai` client, streamed and not."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_reasoning import make_thinking_model, reasoning_worker
from tests.worker.test_responses_api import *  # noqa: F403 (the suite's tests)
from tests.worker.test_tools import parsing_worker
from tests.worker.worker_harness import RunningWorker, worker_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Each test sends one greedy request several times (chat's, the Responses call, the streamed one,
# the raw stream): bf16 answers agree between those runs only without the prefix cache (a later
# prefill starting from cached blocks takes other GEMM shapes: test_engine_gpu.py), so it is off.
CUDA = dict(device="cuda", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters):
    w = RunningWorker(worker_settings(demo_model, demo_adapters, **CUDA)).start()
    assert w.engine.device.type == "cuda"
    yield w
    w.stop()


@pytest.fixture(scope="module")
def auto_worker(demo_model, demo_adapters):
    pytest.importorskip("xgrammar")
    yield from parsing_worker(demo_model, demo_adapters, "hermes", **CUDA)


@pytest.fixture(scope="module")
def r1_worker(demo_model, demo_adapters, tmp_path_factory):
    model = make_thinking_model(demo_model, tmp_path_factory.mktemp("thinking") / "model")
    yield from reasoning_worker(model, demo_adapters, "deepseek_r1", "hermes", **CUDA)

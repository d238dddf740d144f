"""test_structured's engine and API checks, test_tools' function calls and test_reasoning's served
reasoning, again on CUDA: bf16 logits, the masks applied by xgrammar's CUDA path, the served worker
with CUDA graphs and async scheduling (constrained rows sampled once the step before is read)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from tests.worker.test_reasoning import *  # noqa: F403
from tests.worker.test_reasoning import reasoning_worker
from tests.worker.test_structured import *  # noqa: F403 (the suite's tests)
from tests.worker.test_structured import test_free_requests_in_the_same_batch_are_unchanged
from tests.worker.test_tools import *  # noqa: F403
from tests.worker.test_tools import parsing_worker
from tests.worker.worker_harness import RunningWorker, worker_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Greedy bf16 tokens may differ between batch sizes (other GEMM tiles): not a property to check here.
# Between two runs of one request they differ only through the prefix cache (the second prefill
# starts from the first one's cached blocks: test_engine_gpu.py), so the served worker here runs
# without it, and the tests that send one request twice (streamed and not, with and without a
# text response_format) check the same answers on CUDA too.
del test_free_requests_in_the_same_batch_are_unchanged


@pytest.fixture(scope="module")
def engine(demo_model):
    e = LLMEngine(demo_model, EngineConfig(device="cuda", block_size=16, enable_prefix_caching=False))
    assert e.device.type == "cuda"
    return e


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters):
    w = RunningWorker(worker_settings(demo_model, demo_adapters, device="cuda", enable_prefix_caching=False)).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def auto_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "hermes", device="cuda")


@pytest.fixture(scope="module")
def llama3_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "llama3_json", device="cuda")


@pytest.fixture(scope="module")
def mistral_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "mistral", device="cuda")


@pytest.fixture(scope="module")
def pythonic_worker(demo_model, demo_adapters):
    yield from parsing_worker(demo_model, demo_adapters, "pythonic", device="cuda")


@pytest.fixture(scope="module")
def r1_worker(thinking_model, demo_adapters):
    yield from reasoning_worker(thinking_model, demo_adapters, "deepseek_r1", "hermes", device="cuda")


@pytest.fixture(scope="module")
def qwen3_worker(thinking_model, demo_adapters):
    yield from reasoning_worker(thinking_model, demo_adapters, "qwen3", device="cuda")

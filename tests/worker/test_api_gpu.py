"""The public OpenAI API suite (`test_api`) again with the served worker, and the offline engine its
greedy output is compared with, on CUDA: the kernels the GPU path runs (Triton LoRA and attention,
CUDA graphs, async scheduling) behind the real uvicorn server and the official `openai` client.
Tests that build a worker of their own keep theirs on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_api import *  # noqa: F403 (the suite: its tests and its other fixtures)
from tests.worker.worker_harness import RunningWorker, worker_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters, token_file):
    w = RunningWorker(worker_settings(demo_model, demo_adapters, token_file=token_file, device="cuda")).start()
    assert w.engine.device.type == "cuda"
    yield w
    w.stop()

"""The OpenAI-compatibility suites (`test_api_openai_compat`: null fields, n choices, stream options,
unsupported fields; `test_api_sampling_compat`: sampling fields and prompt scoring) again with the
served worker on CUDA: n seeded choices run on the GPU's sampling path, in CUDA graphs with async
scheduling."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_api_openai_compat import *  # noqa: F403 (the suite: its tests and its other fixtures)
from tests.worker.test_api_sampling_compat import *  # noqa: F403
from tests.worker.worker_harness import RunningWorker, worker_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters):
    w = RunningWorker(worker_settings(demo_model, demo_adapters, device="cuda")).start()
    assert w.engine.device.type == "cuda"
    yield w
    w.stop()

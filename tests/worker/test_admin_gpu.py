"""The admin API suite (`test_admin`) again with the served worker on CUDA: runtime loads and unloads
fill and free GPU slots (pinned host copies, the side stream) while the server serves. Tests that
build a worker of their own keep theirs on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_admin import *  # noqa: F403 (the suite: its tests and its other fixtures)
from tests.worker.worker_harness import RunningWorker, worker_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def worker(demo_model, demo_adapters, layout):
    adapters = {n: demo_adapters[n] for n in ("sql", "chat")}
    w = RunningWorker(worker_settings(demo_model, adapters, token_file=layout["token"], adapter_root=layout["root"],
                                      device="cuda")).start()
    assert w.engine.device.type == "cuda"
    yield w
    w.stop()

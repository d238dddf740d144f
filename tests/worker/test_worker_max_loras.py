"""`lorafleet worker --max-loras 1` (vLLM's default, and 2, 3) starts and serves: the per-request
adapter limit defaults to min(4, --max-loras) before it is checked. The worker is a real process
serving a tiny Gemma 2 checkpoint (sliding windows, soft-capping) and its adapter over HTTP, and
its answers equal transformers + PEFT: first-step top-5 logprobs to 2e-3, greedy text for 16 tokens.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
import torch

from lorafleet.worker.engine.tokenizer import Tokenizer
from lorafleet.worker.server.cli import build_parser, settings_from_args

pytest.importorskip("transformers")
pytest.importorskip("peft")

from .family_checkpoints import build, oracle_logprobs  # noqa: E402
from .worker_harness import start_cli_worker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = [5 + (7 * i) % 400 for i in range(40)]
STEPS = 16


@pytest.mark.parametrize("max_loras", [1, 2, 3, 8])
def test_per_request_default_follows_max_loras(max_loras):
    args = build_parser().parse_args(["--model", "m", "--max-loras", str(max_loras), "--max-cpu-loras", "8"])
    assert settings_from_args(args).engine.max_loras_per_request == min(4, max_loras)


def start_worker(folder, max_loras: int) -> tuple[subprocess.Popen, str]:
    return start_cli_worker(["--model", str(folder), "--served-model-name", "tiny", "--device", "cpu", "--dtype",
                             "float32", "--max-loras", str(max_loras), "--lora-modules", f"a={folder / 'adapter'}",
                             "--log-level", "warning"], f"worker --max-loras {max_loras}")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, demo_model):
    folder = tmp_path_factory.mktemp("gemma2")
    return folder, build("gemma2", folder, demo_model)


@pytest.mark.parametrize("max_loras", [1, 2, 3])
def test_worker_starts_and_serves_exactly(max_loras, gemma2):
    folder, peft_model = gemma2
    proc, url = start_worker(folder, max_loras)
    try:
        tok = Tokenizer(folder)
        for model, with_adapter in (("tiny", False), ("a", True)):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "logprobs": 5,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            ids = list(PROMPT)
            for _ in range(STEPS):  # the oracle's greedy continuation
                ids.append(int(oracle_logprobs(peft_model, ids, with_adapter)[-1].argmax()))
            want = oracle_logprobs(peft_model, ids[:-1], with_adapter)[len(PROMPT) - 1 :]
            # the oracle's tokens decoded, less a character cut at the end (vLLM's DecodeStream rule)
            want_text = tok.decode(ids[len(PROMPT):]).rstrip("\ufffd")
            assert choice["text"] == want_text, f"{model}: greedy text differs"
            chosen = want.gather(1, torch.tensor(ids[len(PROMPT):]).unsqueeze(1)).squeeze(1)
            got = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
            assert float((got - chosen).abs().max()) <= 2e-3
            top = sorted(choice["logprobs"]["top_logprobs"][0].values(), reverse=True)
            want_top = want[0].topk(5).values.tolist()
            assert len(top) >= 4  # 5 tokens (+ the chosen one), fewer only where two share a text
            assert all(min(abs(v - w) for w in want_top) <= 2e-3 for v in top)
        if max_loras < 2:  # two adapters in one request exceed min(4, max_loras): a 400, not a crash
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                "lora_adapters": [{"name": "a", "scale": 0.5}, {"name": "a", "scale": 0.5}]})
            assert r.status_code == 400, r.text
    finally:
        proc.kill()
        proc.wait(timeout=10)

"""Every environment variable the worker's engine reads, in one place, read once at import
(start-up). Server settings come from `lorafleet worker`'s flags (server/settings.py); these are
A/B switches for benchmarks and operators. The kernels' own are in `lorafleet.kernels.envs`.

| variable | default | meaning |
|---|---|---|
| `LORAFLEET_BLAS` | `cublaslt` | the BLAS library torch prefers for the base GEMMs on CUDA |
| `LORAFLEET_LORA_OVERLAP` | `1` | `0`: the LoRA side path runs after each GEMM on the main stream instead of beside it |
| `LORAFLEET_PREFILL_BATCH_QUERY` | `128` | query runs up to this many tokens share one padded prefill-attention call (`0`: one call a sequence) |
| `LORAFLEET_LOGIT_EDITS` | `triton` | the per-request logit edits on CUDA: `triton` or `torch` |
| `LORAFLEET_SAMPLER` | `triton` | the sampled draw on CUDA: `triton` or `torch` |
| `LORAFLEET_ADAPTER_CACHE_DIR` | `$TMPDIR/lorafleet-adapters` | where `s3://` and `hf://` adapters are fetched to (worker/lora/fetch.py) |
| `LORAFLEET_ADAPTER_CACHE_BYTES` | 20 GiB | that cache's bound in bytes (least recently used folders removed first) |
| `LORAFLEET_ADAPTER_FETCH_ATTEMPTS` | `5` | tries per remote call on transient errors (5xx, 429, resets, timeouts), with back-off |
| `LORAFLEET_SWITCH_INTERVAL_US` | unset (Python's 5,000) | the interpreter's thread switch interval while the engine thread runs (`sys.setswitchinterval`): how long the engine thread, ready to launch a step, may wait for the GIL while the HTTP loop runs Python |
| `LORAFLEET_WORKER_LOOP` | `asyncio` | the HTTP servers' event loop: `asyncio` or `uvloop` (common/event_loop.py says why asyncio's) |
| `VLLM_API_KEY` | unset | vLLM's: the API key `/v1/*` requires when `--api-key` is not given |
"""

from __future__ import annotations

import os

BLAS = os.environ.get("LORAFLEET_BLAS", "cublaslt")
LORA_OVERLAP = os.environ.get("LORAFLEET_LORA_OVERLAP", "1") != "0"
PREFILL_BATCH_QUERY = int(os.environ.get("LORAFLEET_PREFILL_BATCH_QUERY", "128"))
LOGIT_EDITS = os.environ.get("LORAFLEET_LOGIT_EDITS", "triton")
SAMPLER = os.environ.get("LORAFLEET_SAMPLER", "triton")
ADAPTER_CACHE_DIR = os.environ.get("LORAFLEET_ADAPTER_CACHE_DIR") or None
ADAPTER_CACHE_BYTES = int(os.environ.get("LORAFLEET_ADAPTER_CACHE_BYTES") or 20 << 30)
ADAPTER_FETCH_ATTEMPTS = int(os.environ.get("LORAFLEET_ADAPTER_FETCH_ATTEMPTS") or 5)
SWITCH_INTERVAL_US = float(os.environ.get("LORAFLEET_SWITCH_INTERVAL_US") or 0) or None
WORKER_LOOP = os.environ.get("LORAFLEET_WORKER_LOOP") or "asyncio"
VLLM_API_KEY = os.environ.get("VLLM_API_KEY") or None

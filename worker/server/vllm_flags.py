"""`lorafleet worker`'s command line as a vLLM user types it.

Every flag the worker shares with vLLM 0.32's OpenAI server takes vLLM's values with vLLM's meaning
(its human-readable integers, dtype aliases, `--lora-modules` forms, underscores for dashes); a default
differs from vLLM's only where the table below says why. A vLLM flag the worker does not implement is
refused with a message saying so, and an unknown flag with another: nothing is silently accepted.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.worker.server.vllm_flag_names import VLLM_FLAGS, VLLM_VERSION

# vLLM's --dtype names for the same types.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")


# vLLM's default --gpu-memory-utilization (CacheConfig's), the worker's too.
VLLM_GPU_MEMORY_UTILIZATION = 0.92


@dataclass(frozen=True, slots=True)
class DefaultDifference:
    flag: str
    ours: str
    vllm: str
    why: str
    device: str | None = None  # the row applies on this device kind only ("cpu"); None: on every device


# Where a default is not vLLM's, and why; every other default is vLLM 0.32's, resolved per device
# where vLLM's is (worker/engine/device_setup.py: --max-num-seqs, --max-num-batched-tokens,
# --block-size, --dtype auto). docs/worker.md shows this table; the worker logs the rows that apply at
# start-up; tests/worker/test_vllm_flag_parity.py checks the vLLM column against the pinned parse of
# vLLM's parser (and tests/vllm/ against vLLM itself).
DEFAULT_DIFFERENCES: tuple[DefaultDifference, ...] = (
    DefaultDifference("--enable-lora", "on (always)", "off", "the product's point: a LoRA server"),
    DefaultDifference("--max-loras", "8", "1",
                      "the product's point: requests for different tenants' adapters share a batch"),
    DefaultDifference("--max-cpu-loras", "max(32, --max-loras)", "--max-loras",
                      "the product's point: many tenants' adapters stay warm in host memory, so a request "
                      "for one costs a copy to the GPU, not a read from disk"),
    DefaultDifference("--max-lora-rank", "64", "16",
                      "the product's point: one pool serves tenants' adapters of mixed ranks (the kernels "
                      "read each at its own rank; the ceiling sizes the slots' memory); vLLM's 16 refuses "
                      "rank-32 and rank-64 fine-tunes"),
    DefaultDifference("--gpu-memory-utilization", "0.92; on CPU unused: the KV cache holds 32768 tokens",
                      "0.92; on CPU of the NUMA node's memory (less what the process holds) for the KV cache, "
                      "unless VLLM_CPU_KVCACHE_SPACE",
                      "the CPU is the test and local-fleet device, where several workers share one host; "
                      "--num-kv-blocks sizes the CPU cache", device="cpu"),
    DefaultDifference("--model", "required", "Qwen/Qwen3-0.6B, downloaded",
                      "the worker serves a local folder and downloads nothing"),
)


def human_readable_int(text: str) -> int:
    """vLLM's integers: `2048`, `1k` (1000), `1K` (1024), `25.6k` (25600); no decimals with K/M/G/T."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like {suffix} "
                                         f"(did you mean {number}{suffix.lower()}?)")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def model_len(text: str) -> int:
    """`--max-model-len`: vLLM's integers; its -1/auto (the longest the KV cache fits) is not implemented."""
    if text.strip() == "-1" or text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError(f"{text!r} (vLLM's length fitted to the KV cache) is not implemented: "
                                         "give a length, or leave the flag out for the model's")
    return human_readable_int(text)


def normalize(argv: Sequence[str]) -> list[str]:
    """vLLM's spelling rule: underscores in a `--flag` name (before any `=` or `.`) are dashes."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            head, dot, tail = name.partition(".")
            arg = head.replace("_", "-") + dot + tail + sep + value
        out.append(arg)
    return out


def refusal(token: str) -> str:
    """Why a flag the parser did not take is refused: a vLLM flag not implemented, or an unknown one."""
    flag = token.partition("=")[0]
    base = flag.partition(".")[0]
    if base in VLLM_FLAGS:
        return (f"{base} is a vLLM {VLLM_VERSION} flag that lorafleet worker does not implement; remove it "
                "(docs/worker.md lists the vLLM flags the worker takes)")
    return f"unknown flag {flag}: neither a lorafleet worker flag nor a vLLM {VLLM_VERSION} one (see --help)"


class VllmCompatibleParser(argparse.ArgumentParser):
    """argparse with vLLM's underscore spelling, and unknown arguments refused with `refusal`."""

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        argv = normalize(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(argv, namespace)
        flags = [e for e in extras if e.startswith("-") and not _is_number(e)]
        if flags:
            self.error(refusal(flags[0]))
        if extras:
            self.error(f"unexpected argument(s): {' '.join(extras)}")
        return parsed

    def error(self, message: str):  # type: ignore[override]
        """The reason on one line (argparse's usage block would bury it)."""
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def log_default_differences(log: logging.Logger, argv: Sequence[str], device: str = "cpu") -> None:
    """At start-up: each default that differs from vLLM's and applies (its flag not given, on this
    `--device`). The defaults taken from vLLM per device are logged by the engine once resolved."""
    given = {a.partition("=")[0] for a in normalize(argv) if a.startswith("--")}
    kind = device.partition(":")[0]
    rows = [d for d in DEFAULT_DIFFERENCES if d.flag not in given and d.flag not in ("--model", "--enable-lora")
            and d.device in (None, kind)]
    if rows:
        log.info("defaults that differ from vLLM %s's (docs/worker.md): %s", VLLM_VERSION,
                 "; ".join(f"{d.flag} {d.ours} (vLLM: {d.vllm})" for d in rows))

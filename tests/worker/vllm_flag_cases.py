"""A table of vLLM command lines and what vLLM 0.32's own parser makes of them, pinned, for the
flag-parity tests: tests/worker/test_vllm_flag_parity.py holds `lorafleet worker` to them (always,
in CI), tests/vllm/test_flag_parity.py re-derives every pinned value from vLLM's parser itself.

`vllm` is vLLM's parse where it differs from VLLM_DEFAULTS' (the parse of `--model` alone), or
`{"error": ...}` where vLLM refuses the line. `ours` says what the worker does with the line:
"same" (the same settings, but for the defaults in vllm_flags.DEFAULT_DIFFERENCES), "vllm-flag"
(a vLLM flag the worker does not implement: refused, naming it as such), "refused" (a value the
worker does not implement, or one vLLM refuses too: refused), "unknown" (neither side's flag),
or "more: why" (the worker takes more than vLLM, for that reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODEL = ("--model", "/models/m")

# The settings compared, by vLLM's namespace names.
SETTINGS = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
            "gpu_memory_utilization", "lora_modules", "enable_lora", "served_model_name", "dtype", "seed",
            "block_size", "enable_prefix_caching", "host", "port", "tensor_parallel_size", "api_key",
            "enforce_eager")

# vLLM 0.32.0: `python -m vllm.entrypoints.openai.api_server --model /models/m`, parsed.
VLLM_DEFAULTS: dict[str, Any] = {
    "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None, "max_model_len": None, "max_num_seqs": None,
    "max_num_batched_tokens": None, "gpu_memory_utilization": 0.92, "lora_modules": None, "enable_lora": None,
    "served_model_name": None, "dtype": "auto", "seed": 0, "block_size": None, "enable_prefix_caching": None,
    "host": None, "port": 8000, "tensor_parallel_size": 1, "api_key": None, "enforce_eager": False,
}


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    vllm: dict[str, Any] = field(default_factory=dict)
    ours: str = "same"

    @property
    def id(self) -> str:
        return " ".join(self.argv) or "defaults"


CASES: tuple[Case, ...] = (
    Case(()),
    Case(("--max-loras", "1")),
    Case(("--max-loras", "3", "--max-cpu-loras", "5"), {"max_loras": 3, "max_cpu_loras": 5}),
    Case(("--max-loras", "40"), {"max_loras": 40}),
    Case(("--max_loras=2", "--max_lora_rank", "32"), {"max_loras": 2, "max_lora_rank": 32}),
    Case(("--max-lora-rank", "512"), {"max_lora_rank": 512}),
    Case(("--max-cpu-loras", "64"), {"max_cpu_loras": 64}),
    Case(("--max-model-len", "4096"), {"max_model_len": 4096}),
    Case(("--max-model-len", "1k"), {"max_model_len": 1000}),
    Case(("--max-model-len", "2K"), {"max_model_len": 2048}),
    Case(("--max-model-len=25.6k",), {"max_model_len": 25600}),
    Case(("--max-num-seqs", "7"), {"max_num_seqs": 7}),
    Case(("--max-num-batched-tokens", "8k"), {"max_num_batched_tokens": 8000}),
    Case(("--max-num-batched-tokens", "4096"), {"max_num_batched_tokens": 4096}),
    Case(("--gpu-memory-utilization", "0.45"), {"gpu_memory_utilization": 0.45}),
    Case(("--device-memory-utilization", "0.5"), {"gpu_memory_utilization": 0.5}),
    Case(("--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'),
         {"lora_modules": [["sql", "/a/sql"], ["chat", "/a/chat"]]}),
    Case(("--enable-lora",), {"enable_lora": True}),
    Case(("--served-model-name", "base"), {"served_model_name": ["base"]}),
    Case(("--dtype", "half"), {"dtype": "half"}),
    Case(("--dtype", "float"), {"dtype": "float"}),
    Case(("--dtype", "bfloat16"), {"dtype": "bfloat16"}),
    Case(("--seed", "1234"), {"seed": 1234}),
    Case(("--block-size", "32"), {"block_size": 32}),
    Case(("--enable-prefix-caching",), {"enable_prefix_caching": True}),
    Case(("--no-enable-prefix-caching",), {"enable_prefix_caching": False}),
    Case(("--host", "127.0.0.1", "--port", "9001"), {"host": "127.0.0.1", "port": 9001}),
    Case(("-tp", "1")),
    Case(("--tensor-parallel-size", "1")),
    Case(("-tp", "2"), {"tensor_parallel_size": 2}),
    Case(("--api-key", "k1"), {"api_key": ["k1"]}),
    Case(("--api-key", "k1", "k2"), {"api_key": ["k1", "k2"]}),
    Case(("--enforce-eager",), {"enforce_eager": True}),
    # refused by both
    Case(("--max-loras", "x"), {"error": "argument --max-loras: invalid int value: 'x'"}, "refused"),
    Case(("--dtype", "int8"), {"error": "argument --dtype: invalid choice: 'int8'"}, "refused"),
    Case(("--max-model-len", "1.5K"), {"error": "argument --max-model-len: Decimals are not allowed with binary "
                                                "suffixes like K"}, "refused"),
    Case(("--served-model-name",), {"error": "argument --served-model-name: expected at least one argument"},
         "refused"),
    Case(("--no-such-flag",), {"error": "unrecognized arguments: --no-such-flag"}, "unknown"),
    # vLLM's flags the worker does not implement (vLLM takes them)
    Case(("--kv-cache-dtype", "fp8"), {}, "vllm-flag"),
    Case(("--kv_cache_dtype", "fp8"), {}, "vllm-flag"),
    Case(("--trust-remote-code",), {}, "vllm-flag"),
    Case(("--disable-log-stats",), {}, "vllm-flag"),
    Case(("--lora-dtype", "bfloat16"), {}, "vllm-flag"),
    Case(("-pp", "2"), {}, "vllm-flag"),
    Case(("--compilation-config.mode", "3"), {}, "vllm-flag"),
    # vLLM's values the worker does not implement
    Case(("--no-enable-lora",), {"enable_lora": False}, "refused"),
    Case(("--served-model-name", "a", "b"), {"served_model_name": ["a", "b"]}, "refused"),
    Case(("--max-model-len", "auto"), {"max_model_len": -1}, "refused"),
    Case(("--block-size", "256"), {"block_size": 256}, "refused"),
    # the worker takes more
    Case(("--max-lora-rank", "48"), {"error": "argument --max-lora-rank: invalid choice: 48"},
         "more: a slot keeps its adapter's own rank, so any ceiling up to 512 works (vLLM's kernels take "
         "its listed ranks only)"),
    Case(("--lora-modules", "a=/x", "--lora-modules", "b=/y"), {"lora_modules": [["b", "/y"]]},
         "more: a repeated --lora-modules adds its adapters (vLLM keeps the last occurrence's only)"),
)


def vllm_parse(case: Case) -> dict[str, Any]:
    """The pinned parse of vLLM for `case`: the defaults with its overrides, or its error."""
    return dict(case.vllm) if "error" in case.vllm else {**VLLM_DEFAULTS, **case.vllm}

"""`--help` of every `lorafleet` command: flags grouped by topic (vLLM's habit), each with its
default, and the environment variables the command reads.

Each command builds its parser as before and hands it to `finish(parser, groups, env)`, which moves
every option into its titled group (an option left out is an error, so a new flag must be placed),
shows defaults through `HelpFormatter`, and lists `env` (names from `ENVIRONMENT`) in the epilog.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

# Every environment variable a command reads, and what it does. The commands' epilogs quote these.
ENVIRONMENT: dict[str, str] = {
    "LORAFLEET_SAMPLER": "torch: sample with the torch reference on CUDA too (default triton)",
    "LORAFLEET_LOGIT_EDITS": "torch: penalties and logit bias with torch on CUDA too (default triton)",
    "LORAFLEET_BLAS": "cublaslt (default) or cublas: torch's BLAS library on CUDA",
    "LORAFLEET_LORA_OVERLAP": "0: do not overlap the LoRA kernels with the base GEMM (default 1)",
    "LORAFLEET_PREFILL_BATCH_QUERY": "prefill queries batched per attention call (default 128; 0: one call "
                                     "per sequence)",
    "LORAFLEET_PDL": "0: no programmatic dependent launch in the Triton kernels (default 1)",
    "LORAFLEET_OVERLAP_MAX_CHUNKS": "most chunks the LoRA/GEMM overlap splits a matmul into (default: no cap)",
    "LORAFLEET_GEMM_SM_CARVEOUT": "SMs kept from the base GEMM for the LoRA kernels: N, N,M or A,B,C,D "
                                  "(default 48,80,48,48)",
    "LORAFLEET_LORA_FEW_CHUNKS": "the LoRA side path's few-chunks bound (default 16)",
    "LORAFLEET_GEMM_FIRST": "the base GEMM launched before the LoRA kernels beside it, few,many chunks (default 1,1)",
    "LORAFLEET_DELTA_STORE": "with one adapter a token the expand stores the delta, few,many chunks (default 1,1)",
    "LORAFLEET_ZERO_IN_SHRINK": "0: a memset zeroes the LoRA delta above the few-chunks bound (default 1)",
    "LORAFLEET_LORA_TUNING": "the LoRA kernels' tuning overridden: a JSON file's path or inline JSON "
                             "(default: kernels/lora/tunings/ by device)",
    "LORAFLEET_ADAPTER_CACHE_DIR": "where adapters fetched from S3 or the Hub are cached (default "
                                   "$TMPDIR/lorafleet-adapters)",
    "LORAFLEET_ADAPTER_CACHE_BYTES": "the remote adapter cache's size bound in bytes (default 20 GiB)",
    "LORAFLEET_ADAPTER_FETCH_ATTEMPTS": "tries per S3/Hub call on transient errors, with back-off (default 5)",
    "LORAFLEET_FP8_TUNING": "the FP8 GEMM's tuning overridden: a JSON file's path or inline JSON "
                            "(default: kernels/quant/tunings/ by device)",
    "TRITON_INTERPRET": "1: run the Triton kernels in Triton's interpreter (CPU; tests)",
    "LORAFLEET_SWITCH_INTERVAL_US": "the GIL switch interval while the engine thread runs, in µs (default: "
                                    "Python's 5,000)",
    "LORAFLEET_WORKER_LOOP": "the worker's event loop: asyncio (default) or uvloop",
    "VLLM_API_KEY": "vLLM's: the key `lorafleet worker`'s /v1/* requires without --api-key (not passed on to "
                    "`lorafleet up`'s workers)",
    "LORAFLEET_REDIS_URL": "the default of --redis-url",
    "POD_NAMESPACE": "the namespace watched without --namespace (set from the pod's metadata)",
    "HOSTNAME": "the pod's name, from which the peering priority is derived without --priority",
    "XDG_CACHE_HOME": "where the demo model and adapters are cached (default ~/.cache)",
}
WORKER_ENV = ("LORAFLEET_SAMPLER", "LORAFLEET_LOGIT_EDITS", "LORAFLEET_BLAS", "LORAFLEET_LORA_OVERLAP",
              "LORAFLEET_PREFILL_BATCH_QUERY", "LORAFLEET_PDL", "LORAFLEET_OVERLAP_MAX_CHUNKS",
              "LORAFLEET_GEMM_SM_CARVEOUT", "LORAFLEET_LORA_FEW_CHUNKS", "LORAFLEET_GEMM_FIRST",
              "LORAFLEET_DELTA_STORE", "LORAFLEET_ZERO_IN_SHRINK", "LORAFLEET_LORA_TUNING", "LORAFLEET_FP8_TUNING",
              "LORAFLEET_ADAPTER_CACHE_DIR",
              "LORAFLEET_ADAPTER_CACHE_BYTES", "LORAFLEET_ADAPTER_FETCH_ATTEMPTS", "LORAFLEET_SWITCH_INTERVAL_US",
              "LORAFLEET_WORKER_LOOP", "TRITON_INTERPRET",
              "VLLM_API_KEY")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help already says it; the description
    and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or action.required:
            return text
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            return text
        default = action.default
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction) or \
                isinstance(default, bool):
            shown = "on" if default else "off"
        elif default is None or default == []:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def finish(parser: argparse.ArgumentParser, groups: Mapping[str, Sequence[str]],
           env: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Moves each option (named by one of its flags) into its titled group, in the groups' order."""
    parser.formatter_class = HelpFormatter
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    placed: set[int] = set()
    for title, flags in groups.items():
        group = parser.add_argument_group(title)
        for flag in flags:
            action = by_flag[flag]
            for container in parser._action_groups:
                if action in container._group_actions and container is not group:
                    container._group_actions.remove(action)
            group._group_actions.append(action)
            placed.add(id(action))
    loose = [a.option_strings[0] for a in parser._actions
             if a.option_strings and id(a) not in placed and not isinstance(a, argparse._HelpAction)]
    if loose:
        raise ValueError(f"{parser.prog}: options in no group: {', '.join(loose)}")
    parser.epilog = environment_epilog(env)
    return parser


def environment_epilog(names: Sequence[str]) -> str:
    if not names:
        return "environment variables: none read (every setting is a flag)"
    width = max(map(len, names))
    lines = ["environment variables read:"]
    lines += [f"  {name:<{width}}  {ENVIRONMENT[name]}" for name in names]
    return "\n".join(lines)

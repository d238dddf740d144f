"""`lorafleet worker`: parse vLLM-named flags into `WorkerSettings`, then serve with uvicorn.

The flags shared with vLLM take vLLM's values with vLLM's meaning (vllm_flags.py); defaults that
differ (several adapters share a batch: `--max-loras 8`) are in `vllm_flags.DEFAULT_DIFFERENCES`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys

from lorafleet.cli import lora_module_arg
from lorafleet.cli_help import WORKER_ENV, finish
from lorafleet.connection_guard import add_connection_flags, limits_from_args, uvicorn_config
from lorafleet.event_loop import loop_factory
from lorafleet.worker import envs
from lorafleet.worker.config import ConfigError, EngineConfig, ModelConfig
from lorafleet.worker.openai.reasoning import PARSERS as REASONING_PARSERS
from lorafleet.worker.openai.tools import PARSERS
from lorafleet.worker.server.settings import WorkerSettings
from lorafleet.worker.server.vllm_flags import (
    DTYPE_ALIASES,
    DTYPES,
    VLLM_GPU_MEMORY_UTILIZATION,
    VllmCompatibleParser,
    human_readable_int,
    log_default_differences,
    model_len,
)

log = logging.getLogger("lorafleet.worker")


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = VllmCompatibleParser(prog="lorafleet worker", description="Serve one base model and many LoRA "
                             "adapters behind an OpenAI-compatible API. Flags shared with vLLM take vLLM's "
                             "values; vLLM's other flags are refused by name.")
    p.add_argument("--model", required=True, help="Hugging Face model folder (config.json + *.safetensors)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="name clients use for the base model (default: --model as given); one name (vLLM's "
                        "further names, aliases, are refused)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    p.add_argument("--host", default="0.0.0.0", help="bind address of the public API (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="public API port (default 8000)")
    p.add_argument("--api-key", nargs="+", metavar="KEY", default=None,
                   help="vLLM's: /v1/* (but the admin routes, which take --admin-token-file's token) requires "
                        "`Authorization: Bearer KEY`, one of these keys (default: $VLLM_API_KEY, else open)")
    p.add_argument("--admin-port", type=int, help="serve the admin API on this port only (default: on --port)")
    p.add_argument("--admin-host", help="bind address of --admin-port (default: --host)")
    p.add_argument("--lora-modules", type=lora_module_arg, nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="adapters loaded at start-up; repeat the flag or list several")
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's; LoRA is always on here, so --no-enable-lora is refused (default: on)")
    p.add_argument("--max-loras", type=int, default=d.max_loras, help="GPU slots: distinct adapters per batch")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="highest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help=f"adapters kept in the CPU cache (default: max({d.max_cpu_loras}, --max-loras))")
    # None until EngineConfig applies min(4, --max-loras): a fixed 4 would refuse --max-loras 1..3.
    p.add_argument("--max-loras-per-request", type=int, default=None,
                   help="adapters one request may compose (the RFC's lora_adapters; default min(4, --max-loras))")
    p.add_argument("--adapter-root", help="runtime loads must resolve inside this folder (else refused)")
    p.add_argument("--admin-token-file", help="file holding the admin bearer token (else the admin API is off)")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights' and activations' dtype; half = float16, float = float32 (vLLM's names) "
                        "(auto, vLLM's: the checkpoint's half type, bfloat16 for a float32 one, on CPU too; "
                        "give float32 for exact CPU runs)")
    p.add_argument("--quantization", "-q", default=d.quantization, choices=["fp8"],
                   help="fp8: the decoder's projections in FP8 (e4m3, a scale per output channel; embeddings, "
                        "lm_head, KV cache and adapters stay in --dtype). FP8 checkpoints are served as FP8 without it")
    p.add_argument("--load-format", default=d.load_format,
                   help="auto or safetensors: the folder's *.safetensors; dummy: random weights of the "
                        "checkpoint's shapes (config.json and tokenizer only; for benchmarks) (vLLM's flag)")
    p.add_argument("--max-model-len", type=model_len, default=d.max_model_len,
                   help="longest prompt + answer in tokens, vLLM's forms (2048, 1k = 1000, 1K = 1024) "
                        "(default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences running at once (default, vLLM's for the device: 128 on CPU, 1024 on GPUs from "
                        "70 GiB but A100s, 256 on others; at most --max-num-batched-tokens)")
    p.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                   help="tokens one engine step processes (2048, 2k, 2K as in vLLM) (default, vLLM's for the "
                        "device: 2048 on CPU and most GPUs, 8192 from 70 GiB but A100s, 16384 from 160 GiB)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV-cache block (default, vLLM's: 16 on CUDA, 128 on CPU)")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV blocks (default: from memory)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="instead of --gpu-memory-utilization: the KV cache's share of the GPU memory free after "
                        "weights and adapter slots (e.g. 0.9)")
    p.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=None,
                   help="vLLM's: this worker's share of the GPU's total memory (weights, slots, KV cache, "
                        f"activations, CUDA graphs), so several workers can share a GPU (default {VLLM_GPU_MEMORY_UTILIZATION:g}, "
                        "vLLM's; unused on CPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="share the KV blocks of common prompt prefixes (per adapter)")
    p.add_argument("--lora-backend", default=d.lora_backend, choices=["auto", "torch", "triton"],
                   help="LoRA kernels: auto = Triton on CUDA, torch on CPU")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"],
                   help="decode attention: auto = the Triton paged kernel on CUDA, torch on CPU")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                   help="replay decode steps from a CUDA graph per batch-size bucket (default: on for CUDA "
                        "with the triton backends)")
    p.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="no CUDA graphs (vLLM's name for --no-cuda-graphs)")
    p.add_argument("--no-enforce-eager", dest="cuda_graphs", action="store_const", const=None,
                   help="vLLM's: CUDA graphs where they apply (the default)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="vLLM's: shard the model (and every adapter) over N devices, one process each; rank 0 "
                        "serves and starts the others (docs/tensor_parallel.md)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="launch each decode step before reading the previous one's tokens, overlapping the "
                        "host's work with the GPU (default: on where decode steps replay CUDA graphs)")
    p.add_argument("--async-admission", action=argparse.BooleanOptionalAction, default=d.async_admission,
                   help="with async scheduling, launch steps where prompts join the decodes before reading "
                        "the step in flight too (default: off until measured on a GPU; CPU tests show the same outputs)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=d.warmup,
                   help="before serving, run warm-up prompts and capture the decode graphs, so the first "
                        "requests do not pay compiles and captures (default: on for CUDA)")
    p.add_argument("--pinned-lora-modules", nargs="+", action="extend", default=[], metavar="NAME",
                   help="start-up adapters never evicted from the GPU")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help="answer tool_choice \"auto\" (the default with tools): the model's calls are parsed out "
                        "of its answer in the --tool-call-parser format")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>: Qwen 2.5/3, Hermes), "
                        "llama3_json ({\"name\": ..., \"parameters\": ...}; ...: Llama 3.1-3.3), "
                        "mistral ([TOOL_CALLS][{json}, ...] or [TOOL_CALLS]name[ARGS]{json}: Mistral), "
                        "pythonic ([name(key=value, ...), ...]: Llama 3.2, Llama 4)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split chat answers' reasoning (<think>...</think>) into the message's reasoning field: "
                        "deepseek_r1 (DeepSeek R1, QwQ: answers begin in their reasoning), qwen3 (Qwen3: when "
                        "the answer or the prompt opens it)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the shared sampling generator")
    add_connection_flags(p)
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"], help="log level (any case, as vLLM's)")
    return finish(p, {
        "Model": ["--model", "--served-model-name", "--tokenizer", "--dtype", "--quantization", "--load-format", "--device",
                  "--max-model-len", "--seed"],
        "Server": ["--host", "--port", "--api-key", "--admin-port", "--admin-host", "--admin-token-file",
                   "--log-level"],
        "Adapters (LoRA)": ["--lora-modules", "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
                            "--max-loras-per-request", "--pinned-lora-modules", "--adapter-root"],
        "Scheduling and memory": ["--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--num-kv-blocks",
                                  "--kv-cache-memory-fraction", "--gpu-memory-utilization",
                                  "--enable-prefix-caching", "--tensor-parallel-size"],
        "Kernels and execution": ["--lora-backend", "--attention-backend", "--cuda-graphs", "--enforce-eager",
                                  "--no-enforce-eager",
                                  "--async-scheduling", "--async-admission", "--warmup"],
        "Tools and reasoning": ["--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"],
        "Client connections": ["--header-timeout", "--body-timeout", "--keep-alive-timeout",
                               "--max-client-connections", "--max-server-connections"],
    }, WORKER_ENV)


def engine_config(args: argparse.Namespace, max_cpu_loras: int) -> EngineConfig:
    fraction = {} if args.kv_cache_memory_fraction is None else {"kv_cache_memory_fraction": args.kv_cache_memory_fraction}
    utilization = args.gpu_memory_utilization
    if utilization is None and args.kv_cache_memory_fraction is None:
        utilization = VLLM_GPU_MEMORY_UTILIZATION
    return EngineConfig(
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=max_cpu_loras,
        max_loras_per_request=args.max_loras_per_request, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        device=args.device, dtype=DTYPE_ALIASES.get(args.dtype, args.dtype), quantization=args.quantization,
        load_format=args.load_format,
        lora_backend=args.lora_backend,
        attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs, async_scheduling=args.async_scheduling,
        async_admission=args.async_admission,
        warmup=args.warmup,
        pinned_adapters=tuple(args.pinned_lora_modules), seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        **fraction,
    )


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    if args.enable_lora is False:
        raise ConfigError("--no-enable-lora: LoRA is always on in lorafleet worker (serve the base model by "
                          "naming it; leave the flag out)")
    names = args.served_model_name or [None]
    if len(names) > 1:
        raise ConfigError(f"--served-model-name {' '.join(names)}: one name; vLLM's further names (aliases) "
                          "are not implemented")
    max_cpu_loras = args.max_cpu_loras
    if max_cpu_loras is None:
        max_cpu_loras = max(EngineConfig().max_cpu_loras, args.max_loras)
    keys = tuple(k for k in (args.api_key or [envs.VLLM_API_KEY]) if k)  # the flag before the env, as vLLM
    if args.gpu_memory_utilization is not None and args.kv_cache_memory_fraction is not None:
        raise ConfigError("--gpu-memory-utilization and --kv-cache-memory-fraction size the KV cache two ways; give one")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ConfigError("--enable-auto-tool-choice and --tool-call-parser go together (vLLM's rule): give both or neither")
    try:
        engine = engine_config(args, max_cpu_loras)
    except ConfigError as exc:  # its fields named as the flags that set them
        raise ConfigError(re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: "--" + m[0].replace("_", "-")
                                 if m[0] in vars(args) else m[0], str(exc))) from None
    return WorkerSettings(
        model=args.model, served_model_name=names[0], tokenizer=args.tokenizer, host=args.host, api_keys=keys,
        port=args.port, admin_port=args.admin_port, lora_modules=tuple(args.lora_modules),
        adapter_root=args.adapter_root, admin_token_file=args.admin_token_file, engine=engine,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        connection_limits=limits_from_args(args),
    )


async def serve(settings: WorkerSettings, log_level: str = "info", admin_host: str | None = None) -> int:
    """Serve until stopped; 1 if the engine failed to start (a wrong --lora-modules path, ...)."""
    import uvicorn

    from lorafleet.worker.server.app import create_apps

    public, admin = create_apps(settings)
    limits = settings.connection_limits
    servers = [uvicorn.Server(uvicorn_config(public, settings.host, settings.port, limits, log_level=log_level))]
    if admin is not None:
        servers.append(uvicorn.Server(uvicorn_config(
            admin, admin_host or settings.host, settings.admin_port, limits, log_level=log_level, lifespan="off",
        )))
    runtime = public.state.runtime

    async def exit_if_engine_fails() -> None:
        while runtime.error is None:
            await asyncio.sleep(0.2)
        for server in servers:
            server.should_exit = True

    watcher = asyncio.create_task(exit_if_engine_fails())
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        watcher.cancel()
    return 1 if runtime.error is not None else 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        ModelConfig.from_folder(settings.model)  # fail fast on a wrong --model
    except ConfigError as exc:
        print(f"lorafleet worker: {exc}", file=sys.stderr)
        return 2
    log_default_differences(log, argv, args.device)
    if settings.admin_token_file is None:
        log.warning("no --admin-token-file: the admin API (load/unload, /v1/adapters) refuses every call")
    if settings.adapter_root is None:
        log.warning("no --adapter-root: runtime adapter loads are refused")
    try:
        factory = loop_factory(envs.WORKER_LOOP)
    except ValueError as exc:
        print(f"lorafleet worker: LORAFLEET_WORKER_LOOP: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(serve(settings, args.log_level, args.admin_host))
    except (OSError, ValueError) as exc:  # port taken, unreadable token file, ...
        print(f"lorafleet worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0

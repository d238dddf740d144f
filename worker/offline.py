"""`lorafleet generate`: run prompts through the engine without a server (batch, mixed adapters).

    lorafleet generate --model DIR --lora-modules sql=DIR ... --prompt "Hello" --adapter sql \
        --prompt "Hi" --adapter "sql:0.7,poem:0.5" --max-tokens 32 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from lorafleet.cli import lora_module_arg
from lorafleet.cli_help import WORKER_ENV, finish
from lorafleet.worker.config import ConfigError, EngineConfig
from lorafleet.worker.lora.adapter import AdapterError


def parse_adapter_set(text: str) -> list[tuple[str, float]]:
    """"" = base; "sql" = one adapter; "sql:0.7,poem:0.5" = composed with scales."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, scale = part.partition(":")
        try:
            out.append((name, float(scale) if scale else 1.0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad adapter scale in {part!r}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet generate", description="Offline batched generation.")
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--lora-modules", type=lora_module_arg, nargs="*", default=[], metavar="NAME=PATH",
                   help="adapters to load")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--adapter", action="append", default=[], help="per prompt: '', 'name' or 'a:0.7,b:0.5' "
                   "(default: the base model)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--max-loras", type=int, default=8, help="distinct adapters per batch")
    p.add_argument("--max-lora-rank", type=int, default=64, help="highest adapter rank accepted")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, the checkpoint's half type on CUDA), "
                   "float32, bfloat16 or float16")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap decode steps' host work (default: on with CUDA graphs)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return finish(p, {
        "Model": ["--model", "--device", "--dtype"],
        "Adapters": ["--lora-modules", "--adapter", "--max-loras", "--max-lora-rank"],
        "Prompts and sampling": ["--prompt", "--max-tokens", "--temperature", "--seed", "--async-scheduling"],
        "Output": ["--json"],
    }, WORKER_ENV)


def main(argv: list[str]) -> int:
    from lorafleet.worker.engine.engine import LLMEngine, RequestError
    from lorafleet.worker.engine.sequence import SamplingParams

    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        modules = dict(args.lora_modules)
        adapter_sets = [parse_adapter_set(a) for a in args.adapter] + [[]] * (len(args.prompt) - len(args.adapter))
        if len(adapter_sets) != len(args.prompt):
            p.error("more --adapter than --prompt")
        config = EngineConfig(max_loras=args.max_loras, max_cpu_loras=max(args.max_loras, len(modules)),
                              max_lora_rank=args.max_lora_rank, device=args.device,
                              dtype=None if args.dtype == "auto" else args.dtype,  # the engine's: exact on CPU
                              async_scheduling=args.async_scheduling)
        engine = LLMEngine(args.model, config, lora_modules=modules)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        outs = engine.generate(args.prompt, sp, adapter_sets)
    except (argparse.ArgumentTypeError, ConfigError, AdapterError, RequestError, ValueError, KeyError) as exc:
        print(f"lorafleet generate: {exc}", file=sys.stderr)
        return 2
    for prompt, adapters, out in zip(args.prompt, adapter_sets, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "adapters": adapters, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            label = ",".join(f"{n}:{s:g}" for n, s in adapters) or "base"
            print(f"[{label}] {prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0

"""The `lorafleet` command: one thin dispatcher; each subcommand's parser lives with its component.

Components are imported lazily so `lorafleet router` never imports torch and `lorafleet --help`
is instant.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("lorafleet.worker.server.cli", "run a worker: one base model, many LoRA adapters, OpenAI API"),
    "router": ("lorafleet.router.cli", "run the adapter-aware router gateway"),
    "operator": ("lorafleet.operator.cli", "run the Kubernetes operator (kopf)"),
    "demo-assets": ("lorafleet.worker.demo_assets", "write a tiny demo model, tokenizer and PEFT adapters"),
    "generate": ("lorafleet.worker.offline", "offline generation with the engine (no server)"),
    "up": ("lorafleet.local.fleet", "start a local fleet: router + two workers + demo assets"),
    "adapters": ("lorafleet.local.adapters_cli", "manage adapters of a local fleet (apply -f FILE)"),
}


def lora_module_arg(text: str) -> tuple[str, str]:
    """argparse type for vLLM's `--lora-modules` (shared by the worker, router and CLI tools): `name=path`,
    or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}` (base_model_name is
    accepted and not used: an adapter here always serves on the worker's one base model)."""
    import argparse
    import json

    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not valid JSON ({exc})") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        name, path = spec.get("name"), spec.get("path")
        if unknown or not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(
                f"--lora-modules expects {{\"name\": ..., \"path\": ...}} (and optionally \"base_model_name\"), "
                f"got {text!r}" + (f": unknown key(s) {', '.join(unknown)}" if unknown else ""))
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules expects name=path or vLLM's JSON form, got {text!r}")
    return name, path


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: lorafleet COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `lorafleet COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from lorafleet import __version__

        print(f"lorafleet {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lorafleet: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"lorafleet {name}: missing dependency {exc.name!r}; install `lorafleet[all]`", file=sys.stderr)
        return 2
    try:
        code = int(module.main(rest) or 0)
        sys.stdout.flush()  # here, not at exit: output smaller than the buffer is written now
        return code
    except BrokenPipeError:  # `lorafleet adapters get | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush cannot fail again
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    sys.exit(main())

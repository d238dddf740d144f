"""What a worker server is started with (parsed by `worker/server/cli.py`, passed to `create_app`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.connection_guard import ConnectionLimits
from lorafleet.worker.config import ConfigError, EngineConfig


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    model: str  # Hugging Face model folder
    served_model_name: str | None = None  # the `model` clients send for the base; default: --model as given
    tokenizer: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    admin_port: int | None = None  # admin API on its own port (a NetworkPolicy can isolate it)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start-up
    adapter_root: str | None = None  # runtime loads must resolve inside it; None: runtime loads refused
    admin_token_file: str | None = None  # None: the admin API answers 401 to everything
    # vLLM's --api-key: /v1/* (but the admin routes) needs `Bearer <one of them>`; empty: open. Not in repr.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_request_prompts: int = 16  # prompts in one /v1/completions call
    tool_call_parser: str | None = None  # tool_choice "auto"'s format (worker/openai/tools.py); None: "auto" refused
    reasoning_parser: str | None = None  # chat answers' reasoning split out (worker/openai/reasoning.py); None: not
    # Once the engine is built, take start-up's objects out of the cycle collector (gc_freeze.py).
    # Off only where many workers start in one process (tests).
    freeze_gc: bool = True
    connection_limits: ConnectionLimits = ConnectionLimits()  # client connections' deadlines and caps

    def __post_init__(self) -> None:
        # `model: <base name>` means the base model, so an adapter of that name could never be asked for.
        from lorafleet.worker.openai import reasoning
        from lorafleet.worker.openai.tools import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError(f"--tool-call-parser: {self.tool_call_parser!r} is not one of {', '.join(PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning.PARSERS:
            raise ConfigError(f"--reasoning-parser: {self.reasoning_parser!r} is not one of "
                              f"{', '.join(reasoning.PARSERS)}")
        if any(name == self.model_name for name, _ in self.lora_modules):
            raise ConfigError(f"--lora-modules: adapter name {self.model_name!r} is the base model's served name "
                              "(--served-model-name, else --model); choose another")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

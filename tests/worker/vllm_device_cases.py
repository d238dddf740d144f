"""A table of devices and the defaults vLLM 0.32 resolves on each, pinned, for the default-parity tests:
tests/worker/test_device_setup.py holds the worker's resolution (worker/engine/device_setup.py) to
them, tests/vllm/test_flag_parity.py re-derives every pinned value from vLLM's own code (its
`EngineArgs` defaults for the OpenAI server and `_resolve_auto_dtype`, with its platform replaced by
the device's figures; tests/vllm/vllm_defaults.py).

`given` are flags set on the command line (vLLM caps only the defaults it chooses); `dtypes` maps
`family/checkpoint dtype` to what `--dtype auto` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceCase:
    kind: str
    name: str
    total_memory: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int = 4096
    world_size: int = 1
    bf16: bool = True
    given: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.given.items())
        return f"{self.kind} {self.name or ''} tp{self.world_size} len{self.max_model_len}{extra}".strip()

    def for_vllm(self) -> dict[str, Any]:
        """What tests/vllm/vllm_defaults.py reads."""
        return {"kind": self.kind, "name": self.name, "total_memory": self.total_memory, "bf16": self.bf16,
                "max_model_len": self.max_model_len, "world_size": self.world_size, **self.given,
                "checkpoints": [key.split("/") for key in self.dtypes]}


# torch.cuda.get_device_properties(...).total_memory of each card (vLLM asks its platform the same).
H100 = 85_520_809_984  # 79.6 GiB
H200 = 150_754_820_096  # 140.4 GiB
A100_80 = 85_100_000_000
B200 = 191_514_247_168  # 178.4 GiB
L4 = 23_580_639_232

HALF = {"llama/float32": "bfloat16", "llama/bfloat16": "bfloat16", "llama/float16": "float16",
        "gemma2/float16": "bfloat16", "gemma3_text/float32": "bfloat16"}

DEVICE_CASES: tuple[DeviceCase, ...] = (
    DeviceCase("cpu", "", 0, 128, 2048, 128, dtypes=HALF),
    DeviceCase("cpu", "", 0, 256, 4096, 128, world_size=2),
    DeviceCase("cpu", "", 0, 4, 512, 128, max_model_len=128, given={"max_num_seqs": 4}),
    DeviceCase("cuda", "NVIDIA H100 80GB HBM3", H100, 1024, 8192, 16, dtypes=HALF),
    DeviceCase("cuda", "NVIDIA H100 80GB HBM3", H100, 1024, 8192, 16, world_size=4),
    DeviceCase("cuda", "NVIDIA H200", H200, 1024, 8192, 16),
    DeviceCase("cuda", "NVIDIA B200", B200, 1024, 16384, 16),
    DeviceCase("cuda", "NVIDIA A100-SXM4-80GB", A100_80, 256, 2048, 16),
    DeviceCase("cuda", "NVIDIA L4", L4, 256, 2048, 16),
    # A short model: the budget is at most max_num_seqs x max_model_len, max_num_seqs at most the budget.
    DeviceCase("cuda", "NVIDIA H100 80GB HBM3", H100, 256, 512, 16, max_model_len=2, given={"max_num_seqs": 256}),
    DeviceCase("cuda", "NVIDIA H100 80GB HBM3", H100, 300, 300, 16, given={"max_num_batched_tokens": 300}),
    DeviceCase("cuda", "NVIDIA H100 80GB HBM3", H100, 64, 8192, 16, given={"max_num_seqs": 64}),
    DeviceCase("cuda", "Tesla T4", 15_828_320_256, 256, 2048, 16, bf16=False,
               dtypes={"llama/float32": "float16", "llama/bfloat16": "float16", "gemma2/float32": "float32"}),
)

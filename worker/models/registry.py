"""The model class of each family (`ModelConfig.model_type`, chosen from config.json by
`worker/config.family_of`): one module per family under worker/models/."""

from __future__ import annotations

from lorafleet.worker.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from lorafleet.worker.models.gemma2 import Gemma2Model
from lorafleet.worker.models.gemma3 import Gemma3Model
from lorafleet.worker.models.llama import LlamaModel
from lorafleet.worker.models.phi3 import Phi3Model
from lorafleet.worker.models.qwen3 import Qwen3Model

MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": Qwen3Model,
    "gemma2": Gemma2Model,
    "gemma3_text": Gemma3Model,
    "phi3": Phi3Model,
}
assert set(MODEL_CLASSES) == SUPPORTED_ARCHITECTURES


def model_class(config: ModelConfig) -> type[LlamaModel]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise ConfigError(f"model_type {config.model_type!r} has no model class "
                          f"(supported: {', '.join(sorted(MODEL_CLASSES))})") from None

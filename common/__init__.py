"""lorafleet: a fleet of multi-LoRA LLM workers, an adapter-aware router and a Kubernetes operator."""

__version__ = "0.1.0"

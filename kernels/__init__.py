"""lorafleet.kernels: the Triton kernels and their torch references, by family (lora/, attention/,
layers/, sampling/); `envs` holds every environment variable they read."""

from lorafleet.kernels.envs import interpreting

__all__ = ["interpreting"]

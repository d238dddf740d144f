"""The multi-LoRA side path: step metadata, the torch reference op, the Triton shrink/expand programs, their launch and tuned configuration."""

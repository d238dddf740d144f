"""The decoder layer's fused row kernels (RMSNorm, RoPE + KV write, SiLU-mul), each able to add a LoRA delta."""

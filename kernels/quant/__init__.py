"""Weight-only quantized GEMMs (FP8 e4m3 weights, bf16 activations) with their torch references."""

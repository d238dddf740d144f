"""lorafleet.kernels."""

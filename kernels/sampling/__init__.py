"""Sampling kernels: greedy pick, the sampled draw, per-request logit edits."""

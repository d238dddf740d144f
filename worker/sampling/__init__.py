"""Turning a step's logits into tokens: per-request logit edits, structured-output masks, the sampler."""

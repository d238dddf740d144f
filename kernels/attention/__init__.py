"""Paged decode attention in Triton."""

"""The adapter error type: a stable `reason` code (metrics, HTTP errors, CR conditions) and a message."""

from __future__ import annotations


class AdapterError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

"""lorafleet.kernels."""

import os


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"

"""Without CUDA, run the Triton kernels in the interpreter.

The flag is read when a kernel is decorated, so it has to be set before
`lorafleet.kernels.lora.launch` is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

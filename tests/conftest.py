"""Test-session setup shared by all test modules.

Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when a
kernel is decorated (at import), so it is set here, before any test module imports a kernel.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

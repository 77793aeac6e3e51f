"""Test set-up: Triton runs in its interpreter where there is no GPU.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before the test modules import dmuon.kernels.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

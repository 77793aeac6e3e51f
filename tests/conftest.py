"""Test set-up: Triton runs in its interpreter where there is no GPU.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here,
before the test modules import dmuon.kernels.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["python", "native"])
def sim_engine(request, monkeypatch):
    """Each simulator event loop in turn (DMUON_SIM_ENGINE): engine_fast's Python loop and the compiled
    one; skipped for native where it cannot be built here (no C compiler or Python headers)."""
    from dmuon.errors import InputError
    from simulator.engine import engine_native

    monkeypatch.setenv("DMUON_SIM_ENGINE", request.param)
    if request.param == "native":
        try:
            engine_native.load()
        except InputError as e:
            pytest.skip(str(e))
    return request.param

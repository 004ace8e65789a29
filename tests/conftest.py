from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on the CPU through Triton's interpreter; the switch is read when a kernel
# is decorated, so it is set before any test imports one. A CUDA machine runs them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny preset's weights, built once per test session (engines share them read-only)."""
    from libs.engine.loader import load

    return load("tiny", "cpu", torch.float32, seed=0)


@pytest.fixture(scope="session")
def tiny_mtp():
    """The tiny preset with its MTP layer, built once per test session (read-only; tests that
    change it work on a copy)."""
    from libs.engine.loader import load

    return load("tiny", "cpu", torch.float32, 0, with_mtp=True)

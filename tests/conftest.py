from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny preset's weights, built once per test session (engines share them read-only)."""
    from libs.engine.loader import load

    return load("tiny", "cpu", torch.float32, seed=0)

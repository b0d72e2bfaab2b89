"""Triton kernel tests: on CUDA where a GPU exists, else on CPU tensors, which the kernels' launcher
runs through Triton's interpreter (no TRITON_INTERPRET needed; see ops/triton/_common.py)."""

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture
def device() -> str:
    """Where the kernels run: CUDA when present, else CPU tensors in the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long check, run with ROUTEFORMER_SLOW_TESTS=1")

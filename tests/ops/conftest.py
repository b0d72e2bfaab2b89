"""Shared by the op tests: run a test on the native C kernels and on the PyTorch ops."""

import os
import shutil

import pytest
import torch

from routeformer.ops.native import native_kernels


@pytest.fixture(params=["native", "torch"])
def implementation(request, monkeypatch):
    """"native": the fused C kernels of ops/native (skipped only where no C compiler exists; a
    compiler that fails is an error); "torch": the PyTorch ops alone."""
    if request.param == "torch":
        monkeypatch.setenv("ROUTEFORMER_NATIVE", "0")
    elif native_kernels(torch.zeros(1)) is None:
        if shutil.which(os.environ.get("CC") or "cc") is not None:
            pytest.fail("a C compiler exists but the native kernels did not load (see the warning)")
        pytest.skip("no C compiler: the native kernels are unavailable here")
    return request.param

"""The triton range is a promise: the gpu extra's lower bound is OLDEST_TRITON, CI tests it, and
the installed release (the newest pip picked, or the oldest in .ci/run's second pass) is in range."""

import tomllib
from pathlib import Path

import pytest

from routeformer.ops.triton import OLDEST_TRITON

ROOT = Path(__file__).resolve().parents[3]


def test_the_gpu_extra_and_ci_name_the_oldest_triton():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    major_minor = ".".join(OLDEST_TRITON.split(".")[:2])
    assert extras["gpu"] == [f"triton>={major_minor}"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "OLDEST_TRITON" in ci and "tests/ops/triton/test_cuda_compile.py" in ci, \
        "CI must also compile every kernel on the oldest triton"


def test_the_installed_triton_is_in_the_supported_range():
    triton = pytest.importorskip("triton")
    installed = tuple(int(part) for part in triton.__version__.split(".")[:2])
    assert installed >= tuple(int(part) for part in OLDEST_TRITON.split(".")[:2])
